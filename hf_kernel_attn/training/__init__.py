"""Conversion training: attention transfer, then LoRA or full fine-tuning (``hf-kernel-attn finetune``), and the
same pieces for your own scripts (:mod:`.blocks`, :mod:`.losses`)."""

from ..integration.transfer import attention_transfer, softmax_teacher
from .blocks import (
    AttentionTransferModel,
    EmbeddingDistillationModel,
    kernel_parameters,
    teacher_embeddings,
)
from .config import DEFAULTS, ConfigError, load_config
from .losses import distillation_loss
from .stages import TrainingStage, register_stage
from .tasks import TrainingTask, register_task
from .trainer import Trainer, finetune

__all__ = ["DEFAULTS", "AttentionTransferModel", "ConfigError", "EmbeddingDistillationModel", "Trainer",
           "attention_transfer", "distillation_loss", "finetune", "kernel_parameters", "load_config",
           "register_stage", "register_task", "softmax_teacher", "teacher_embeddings", "TrainingStage",
           "TrainingTask"]
