"""Kernel micro-benchmark against SDPA; the same as ``hf-kernel-attn bench`` (see docs/benchmarks.md)."""

import sys

from hf_kernel_attn.speed.kernel_bench_cli import build_parser, main, parse_params, plot  # noqa: F401  (the module's API)

if __name__ == "__main__":
    sys.exit(main())
