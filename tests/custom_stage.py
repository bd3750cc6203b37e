"""A training stage defined outside the package, through the public API only (``register_stage``): the kernels'
own parameters train on ``weight`` times the task loss. tests/test_registry.py names this module under a
training config's ``imports:``."""

from typing import Any

from hf_kernel_attn.training import TrainingStage, register_stage


@register_stage
class ScaledKernelStage(TrainingStage):
    name = "scaled_kernel"
    order = 4  # after full
    defaults = {"lr": 5e-3, "weight": 2.0}

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        w = stage["weight"]
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0):
            return f"stages.scaled_kernel.weight must be a number > 0, got {w!r}"
        return None

    def trains(self) -> str:
        return "kernel"

    def loss(self, batch):
        return self.cfg["weight"] * self.task.loss(self.context.student(), batch)
