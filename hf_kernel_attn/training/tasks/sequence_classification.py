"""Sequence classification / regression on GLUE pairs: the model's head and loss, the task's GLUE metric."""

from __future__ import annotations

from typing import Any

import torch

from ...data import GLUE_TASKS
from ...evaluation.tasks import glue_metrics
from ..data import glue_examples
from .base import TrainingTask, register_task


@register_task
class SequenceClassificationTask(TrainingTask):
    name = "sequence_classification"
    auto_class = "AutoModelForSequenceClassification"
    hub_task = "text-classification"
    pipeline_tag = "text-classification"
    peft_task_type = "SEQ_CLS"
    extra_keys = ("labels",)

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> str | None:
        glue = config["data"]["glue_task"]
        if glue not in GLUE_TASKS:
            return f"task sequence_classification needs data.glue_task, one of {sorted(GLUE_TASKS)}; got {glue!r}"
        return None

    def model_kwargs(self) -> dict[str, Any]:
        glue = GLUE_TASKS[self.context.config["data"]["glue_task"]]
        return {"num_labels": glue.num_labels,
                "problem_type": "regression" if glue.is_regression else "single_label_classification"}

    def load_data(self) -> tuple[Any, Any]:
        return glue_examples(self.context.config)

    def batch(self, items: Any, idx: list[int]) -> tuple[dict[str, Any], int]:
        t = self.context
        rows = [items[i] for i in idx]
        enc = t.encode([r.text_a for r in rows], [r.text_b for r in rows])
        dtype = torch.float if t.model.config.problem_type == "regression" else torch.long
        enc["labels"] = torch.tensor([r.label for r in rows], dtype=dtype, device=t.device)
        return enc, int(enc["attention_mask"].sum())

    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return model(**self.inputs(batch), labels=batch["labels"]).loss

    def validate(self, model: torch.nn.Module, rows: Any, batch_size: int) -> dict[str, float]:
        preds, gold = [], []
        for s in range(0, len(rows), batch_size):
            batch, _ = self.batch(rows, list(range(s, min(len(rows), s + batch_size))))
            logits = model(**self.inputs(batch)).logits
            preds += (logits[:, 0] if logits.shape[-1] == 1 else logits.argmax(-1)).tolist()
            gold += batch["labels"].tolist()
        scores = glue_metrics(self.context.config["data"]["glue_task"], preds, gold)
        return {f"val_{name}": value for name, (value, _) in scores.items()}
