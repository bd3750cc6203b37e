"""``finetune``: convert a model (attention transfer, then distillation / LoRA / full fine-tuning)."""

from __future__ import annotations

import argparse

from .. import training


def finetune_command(args: argparse.Namespace) -> int:
    # through the module (not names bound at import), so that a wrapper or a test's stand-in installed on
    # hf_kernel_attn.training is what runs
    config = training.load_config(args.config, args.set)
    final = training.finetune(config, resume=args.resume)
    print(f"final model: {final}")
    return 0
