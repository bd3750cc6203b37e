"""Distillation (causal LM): LoRA adapters (``train: lora``) or the weights (``train: full``) train on
KL(teacher ‖ student) of the next-token distributions (:func:`..losses.distillation_loss`), plus ``ce_weight`` ×
cross-entropy. The teacher is the same model with softmax attention and its original weights, computed in the
same step: adapters switched off, or (``train: full``, whose weights move) a frozen copy loaded once."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...integration.transfer import softmax_teacher
from ..losses import distillation_loss
from ..tasks import TASK_TYPES
from .base import LORA_DEFAULTS, TrainingStage, Trains, check_lora_keys, register_stage

DISTILL_TRAIN = (Trains.LORA.value, Trains.FULL.value)


@register_stage
class DistillStage(TrainingStage):
    name = "distill"
    order = 1
    defaults = {"max_grad_norm": 1.0, "temperature": 1.0, "ce_weight": 0.0, "train": "lora", **LORA_DEFAULTS}

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        if stage["train"] not in DISTILL_TRAIN:
            return f"stages.distill.train must be one of {list(DISTILL_TRAIN)}, got {stage['train']!r}"
        t = stage["temperature"]
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0):
            return f"stages.distill.temperature must be a number > 0, got {t!r}"
        w = stage["ce_weight"]
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0):
            return f"stages.distill.ce_weight must be a number >= 0, got {w!r}"
        if stage["steps"] and not TASK_TYPES[config["task"]].language_model:
            return (f"stages.distill distils next-token distributions: it needs task causal_lm, got "
                    f"{config['task']!r} (sentence_embedding distils the teacher's embeddings in the lora/full stages)")
        return check_lora_keys("distill", stage)

    def trains(self) -> Trains:
        return Trains(self.cfg["train"])

    @torch.no_grad()
    def teacher_logits(self, batch: dict[str, Any]) -> torch.Tensor:
        t = self.context
        inputs = {**self.task.inputs(batch), "use_cache": False}
        if self.trains() is Trains.FULL:
            if getattr(self, "_teacher_model", None) is None:
                self._teacher_model = t.load_original_model().to(t.device).eval().requires_grad_(False)
            return self._teacher_model(**inputs).logits
        was_training = t.model.training
        t.model.eval()
        try:
            adapters_off = t.model.disable_adapter() if t.is_peft() else contextlib.nullcontext()
            with adapters_off, softmax_teacher():
                return t.model(**inputs).logits
        finally:
            t.model.train(was_training)

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        teacher = self.teacher_logits(batch)
        labels = batch["input_ids"] if self.cfg["ce_weight"] else None
        out = self.context.student()(**self.task.inputs(batch), labels=labels, use_cache=False)
        loss = distillation_loss(out.logits, teacher, temperature=self.cfg["temperature"])
        if self.cfg["ce_weight"]:
            loss = loss + self.cfg["ce_weight"] * out.loss
        return loss
