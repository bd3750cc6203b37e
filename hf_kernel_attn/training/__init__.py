"""Conversion training: attention transfer, then LoRA or full fine-tuning (``hf-kernel-attn finetune``)."""

from .config import DEFAULTS, ConfigError, load_config
from .trainer import Trainer, finetune

__all__ = ["DEFAULTS", "ConfigError", "Trainer", "finetune", "load_config"]
