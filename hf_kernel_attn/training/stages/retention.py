"""Learned retention (TRIM-KV, Bui et al. 2025, arXiv 2512.03324): only the retention gates of softmax layers with
slots train (kernels/retention.py), with every key outside window and sinks weighed by β_j^(t - p_j) inside the
softmax (the soft form), on

    L = τ² · mean_t KL(p_teacher,t ‖ p_student,t)  +  capacity_weight · mean_layers mean_t |E_t - min(C, n_t)| / C

The teacher is the same model with its full softmax attention, computed in the same step; E_t is the sum of
β_j^(t - p_j) over the n_t keys a query could only reach through the slots (the soft cache's expected size). The gates learn which keys the full model
still reads far ahead while the capacity term holds the soft cache to the C slots the hard budget keeps at
inference."""

from __future__ import annotations

from typing import Any

import torch

from ...integration.transfer import softmax_teacher
from ...kernels.retention import capacity_terms
from ..losses import distillation_loss
from ..tasks import TASK_TYPES
from .base import TrainingStage, Trains, register_stage


@register_stage
class RetentionStage(TrainingStage):
    name = "retention"
    order = 4
    defaults = {"lr": 1e-2, "capacity_weight": 1.0, "temperature": 1.0, "max_grad_norm": 1.0}

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        for key in ("capacity_weight", "temperature"):
            x = stage[key]
            if not (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0):
                return f"stages.retention.{key} must be a number >= 0, got {x!r}"
        if not stage["temperature"]:
            return "stages.retention.temperature must be > 0"
        if stage["steps"] and not TASK_TYPES[config["task"]].language_model:
            return f"stages.retention distils next-token distributions: it needs task causal_lm, got {config['task']!r}"
        return None

    def trains(self) -> Trains:
        return Trains.RETENTION

    @torch.no_grad()
    def teacher_logits(self, batch: dict[str, Any]) -> torch.Tensor:
        t = self.context
        was_training = t.model.training
        t.model.eval()
        try:
            with softmax_teacher():
                return t.model(**self.task.inputs(batch), use_cache=False).logits
        finally:
            t.model.train(was_training)

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        teacher = self.teacher_logits(batch)
        with capacity_terms() as terms:
            out = self.context.student()(**self.task.inputs(batch), use_cache=False)
        if not terms:
            raise ValueError("stages.retention trains retention gates, but no layer ran softmax with slots; give the "
                             "model kernel softmax with window, sinks and slots (kernel_params: {slots: C, ...})")
        loss = distillation_loss(out.logits, teacher, temperature=self.cfg["temperature"])
        return loss + self.cfg["capacity_weight"] * torch.stack(terms).mean()
