"""Causal language modelling: packed token blocks, next-token cross-entropy, held-out perplexity."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...evaluation.perplexity import block_nll
from ..data import text_blocks
from .base import TrainingTask, register_task


@register_task
class CausalLMTask(TrainingTask):
    name = "causal_lm"
    auto_class = "AutoModelForCausalLM"
    hub_task = "text-generation"
    pipeline_tag = "text-generation"
    held_out_name = "held-out end of the training text"
    peft_task_type = "CAUSAL_LM"
    language_model = True

    def load_data(self) -> tuple[Any, Any]:
        return text_blocks(self.context.config, self.context.tokenizer)

    def batch(self, items: Any, idx: list[int]) -> tuple[dict[str, Any], int]:
        ids = items[idx].to(self.context.device)
        return {"input_ids": ids}, ids.numel()

    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return model(**self.inputs(batch), labels=batch["input_ids"], use_cache=False).loss

    def validate(self, model: torch.nn.Module, rows: Any, batch_size: int) -> dict[str, float]:
        total, count = block_nll(model, rows, batch_size)
        return {"val_loss": total / count, "val_perplexity": math.exp(total / count)}

    def calibration_batch(self, rows: Any) -> dict[str, Any]:
        return {"input_ids": rows}
