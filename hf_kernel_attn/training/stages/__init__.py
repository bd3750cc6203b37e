"""Training stages behind one registry, run in order: transfer -> distill -> lora -> full -> retention."""

from . import distill, full, lora, retention, transfer  # noqa: F401  (register the built-ins)
from .base import COMMON_DEFAULTS, STAGE_TYPES, TRAINS, TrainingStage, Trains, register_stage, stage_names

__all__ = ["COMMON_DEFAULTS", "STAGE_TYPES", "TRAINS", "Trains", "TrainingStage", "register_stage", "stage_names"]
