"""Attention transfer (Hedgehog, Zhang et al. ICLR 2024; LoLCATs, Zhang et al. ICLR 2025): only the kernels' own
parameters train, on the layer-local loss of :mod:`hf_kernel_attn.integration.transfer`; the model runs in eval
mode and a causal LM skips its LM head (``logits_to_keep=1``)."""

from __future__ import annotations

from typing import Any

import torch

from ...integration.transfer import TRANSFER_LOSSES, attention_transfer
from .base import TrainingStage, Trains, register_stage


@register_stage
class TransferStage(TrainingStage):
    name = "transfer"
    order = 0
    defaults = {"lr": 1e-2, "loss": "mse"}
    train_mode = False  # the teacher and student see no dropout
    applies_auto_choice = False  # the layer and head choices are measured on its result

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        if stage["loss"] not in TRANSFER_LOSSES:
            return f"stages.transfer.loss must be one of {list(TRANSFER_LOSSES)}, got {stage['loss']!r}"
        return None

    def trains(self) -> Trains:
        return Trains.KERNEL

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        ctx = self.context
        kwargs = self.task.inputs(batch)
        if "logits_to_keep" in ctx.forward_kwargs:
            kwargs["logits_to_keep"] = 1  # the LM head is not needed for a layer-local loss
        if "use_cache" in ctx.forward_kwargs:
            kwargs["use_cache"] = False
        with attention_transfer(self.cfg["loss"]) as rec:
            ctx.student()(**kwargs)
            return rec.total()
