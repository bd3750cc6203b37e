"""Sliding-window hybrids against SDPA at long N: interleaved rounds, median per-round ratios.

    python -m hf_kernel_attn.speed.window_bench --length 16384 --window 64 --threads 1 --output OUT.json

Each round runs every configuration once — SDPA (the ``softmax`` kernel), and every chosen feature-map kernel
plain and with ``window=W`` — in an order rotated from round to round; a configuration's ratio in a round is
its time over that round's SDPA time, and the reported ratio is the median over rounds (the method of
:mod:`.model_bench`, for single attention calls). Random q/k/v with SmolLM2's attention shape by default
(9 query heads, 3 KV heads, D = 64), causal, forward only, no autograd.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..kernels import KERNELS, SOFTMAX, LayerShape, build_kernel
from .kernel_bench import machine_info, num_threads

FEATURE_MAPS = sorted(n for n, c in KERNELS.items() if c.is_linear)


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """The shape of the random q, k and v every configuration attends over (SmolLM2's attention by default)."""

    batch: int = 1
    heads: int = 9  # query heads
    kv_heads: int = 3  # key/value heads (grouped-query attention when fewer than ``heads``)
    head_dim: int = 64


def window_speed(
    kernels: Sequence[str] = FEATURE_MAPS,
    *,
    length: int = 16384,
    window: int = 64,
    rounds: int = 5,
    shape: HeadShape | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per configuration: kernel, window (0 = plain), median seconds, median ratio to SDPA (time /
    SDPA time; below 1 is faster), speed-up (its inverse) and the per-round ratios. ``shape``: of q, k, v
    (default: :class:`HeadShape`'s defaults); ``seed``: of their random values."""
    shape = shape or HeadShape()
    batch, heads, kv_heads, head_dim = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    unknown = [k for k in kernels if k not in KERNELS or not KERNELS[k].is_linear]
    if unknown:
        raise ValueError(f"window_speed takes feature-map kernels ({FEATURE_MAPS}); got {unknown}")
    for name, value in (("length", length), ("window", window), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    configs = [(SOFTMAX, 0)] + [(k, w) for k in kernels for w in (0, window)]
    layer = LayerShape(heads, kv_heads, head_dim, 0, max(length, 2048))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    with num_threads(threads), torch.no_grad():
        modules = {c: build_kernel(c[0], layer, {"window": c[1]} if c[1] else None) for c in configs}
        warm = min(length, 1024)
        for module in modules.values():
            module(q[:, :, :warm], k[:, :, :warm], v[:, :, :warm], causal=True)
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for config in order:
                start = time.perf_counter()
                modules[config](q, k, v, causal=True)
                times[config].append(time.perf_counter() - start)
    base = times[(SOFTMAX, 0)]
    rows = []
    for name, w in configs:
        ratios = [t / b for t, b in zip(times[(name, w)], base, strict=True)]
        ratio = statistics.median(ratios)
        rows.append({"kernel": name, "window": w, "length": length, "time_s": statistics.median(times[(name, w)]),
                     "ratio_vs_sdpa": ratio, "speedup_vs_sdpa": 1 / ratio, "round_ratios": ratios})
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| kernel | window | N | median ms | × SDPA time | speed-up vs SDPA |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['window'] or '–'} | {r['length']} | {1e3 * r['time_s']:.1f} | "
                     f"{r['ratio_vs_sdpa']:.3f} | {r['speedup_vs_sdpa']:.1f}× |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_kernel_attn.speed.window_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", default=FEATURE_MAPS)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="write machine, settings and rows as JSON here")
    args = p.parse_args(argv)
    try:
        shape = HeadShape(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
        rows = window_speed(args.kernels, length=args.length, window=args.window, rounds=args.rounds, shape=shape,
                            threads=args.threads)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(format_rows(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"machine": machine_info(), "settings": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
