"""Conversion training: attention transfer, then LoRA or full fine-tuning (``hf-kernel-attn finetune``), and the
same pieces for your own scripts (:mod:`.blocks`, :mod:`.losses`)."""

from typing import Any

from ..integration.transfer import attention_transfer, softmax_teacher
from . import config as _config
from .blocks import (
    AttentionTransferModel,
    EmbeddingDistillationModel,
    kernel_parameters,
    teacher_embeddings,
)
from .config import ConfigError, defaults, load_config
from .context import RunContext
from .losses import distillation_loss
from .stages import TrainingStage, register_stage
from .tasks import TrainingTask, register_task
from .trainer import Trainer, finetune

__all__ = ["DEFAULTS", "AttentionTransferModel", "ConfigError", "EmbeddingDistillationModel", "RunContext", "Trainer",
           "attention_transfer", "defaults", "distillation_loss", "finetune", "kernel_parameters", "load_config",
           "register_stage", "register_task", "softmax_teacher", "teacher_embeddings", "TrainingStage",
           "TrainingTask"]


def __getattr__(name: str) -> Any:
    """``DEFAULTS``: the config defaults as of this access (:func:`.config.defaults`; stages registered later
    join them)."""
    if name == "DEFAULTS":
        return _config.defaults()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "DEFAULTS"})
