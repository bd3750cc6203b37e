"""Full fine-tuning: every weight trains on the task loss (the kernels' parameters too, unless
``train_kernel: false``); the stage ``sharding: fsdp`` shards."""

from __future__ import annotations

from typing import Any

import torch

from .base import TrainingStage, Trains, register_stage


@register_stage
class FullStage(TrainingStage):
    name = "full"
    order = 3
    defaults = {"lr": 2e-5, "max_grad_norm": 1.0, "train_kernel": True}
    fsdp = True

    def trains(self) -> Trains:
        return Trains.FULL

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.task.loss(self.context.student(), batch)
