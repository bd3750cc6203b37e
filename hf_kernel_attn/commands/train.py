"""``finetune``: convert a model (attention transfer, then distillation / LoRA / full fine-tuning)."""

from __future__ import annotations

import argparse

from ..training import finetune, load_config


def finetune_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    final = finetune(config, resume=args.resume)
    print(f"final model: {final}")
    return 0
