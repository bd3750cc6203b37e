"""Kernel studies: ``plot-kernels`` (geometry and real attention maps) and ``synthetic`` (tiny models trained
from scratch on MQAR / ListOps-style tasks)."""

from __future__ import annotations

import argparse

from ..model_paths import locate_model
from ..similarity.plots import SMOLLM2_GGUF, SMOLLM2_PACKAGE, AttentionProbe, plot_kernels
from ..similarity.synthetic import run_many


def plot_kernels_command(args: argparse.Namespace) -> int:
    if args.model and not args.geometry_only:  # before the geometry plots: a wrong model fails at once
        default_gguf = SMOLLM2_GGUF if args.model == SMOLLM2_PACKAGE else None
        locate_model(args.model, args.gguf_file or default_gguf)
    probe = AttentionProbe(model=args.model, gguf_file=args.gguf_file, layer=args.layer, head=args.head,
                           data_file=args.data_file, tokens=args.tokens)
    summary = plot_kernels(args.output_dir, probe, converted=args.converted, threads=args.threads,
                           geometry_only=args.geometry_only, kernels=args.kernels)
    for line in summary["lines"]:
        print(line)
    return 0


def synthetic_command(args: argparse.Namespace) -> int:
    records = run_many(args.task, args.kernel, args.seed, settings=args.setting, output=args.output,
                       steps=args.steps, threads=args.threads)
    for r in records:
        print(f"{r['task']:12s} {r['kernel']:10s} seed {r['seed']}: accuracy {r['value']:6.2f} % "
              f"({r['cpu_seconds']:.0f} CPU-s)")
    return 0
