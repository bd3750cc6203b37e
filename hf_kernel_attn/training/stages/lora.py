"""LoRA through peft on the task loss (LoLCATs: r = 8, α = 16 on the attention projections)."""

from __future__ import annotations

from typing import Any

import torch

from .base import LORA_DEFAULTS, TrainingStage, Trains, check_lora_keys, register_stage


@register_stage
class LoraStage(TrainingStage):
    name = "lora"
    order = 2
    defaults = {"lr": 1e-4, "max_grad_norm": 1.0, **LORA_DEFAULTS}

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        return check_lora_keys("lora", stage)

    def trains(self) -> Trains:
        return Trains.LORA

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.task.loss(self.context.student(), batch)
