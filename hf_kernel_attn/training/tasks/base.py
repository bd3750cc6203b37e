"""What a task brings to a conversion run, behind one registry: adding a task is one new file with a
:class:`TrainingTask` subclass decorated with :func:`register_task`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from ...registry import Registry
from ..context import RunContext


def register_task(cls: type[TrainingTask]) -> type[TrainingTask]:
    """Class decorator: make ``cls`` the task named ``cls.name`` (``task:`` in a finetune config). The same class
    again is fine; another class under a taken name is a ValueError (:class:`hf_kernel_attn.registry.Registry`)."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{getattr(cls, '__name__', repr(cls))} needs a class attribute `name`")
    TASK_TYPES.register(cls.name, cls)
    return cls


class TrainingTask:
    """One task: its model class, data, batches, loss and held-out score.

    ``items`` are what :meth:`load_data` returned (token blocks, GLUE rows, sentences); a batch is a dict of model
    inputs plus the keys :attr:`extra_keys` names (targets the model does not take)."""

    name: ClassVar[str] = ""
    auto_class: ClassVar[str] = "AutoModel"  # the transformers Auto class that loads the model
    peft_task_type: ClassVar[str | None] = None  # peft's TaskType for LoRA adapters
    extra_keys: ClassVar[tuple[str, ...]] = ()  # batch keys that are not model inputs
    hub_task: ClassVar[str] = "feature-extraction"  # the model card's task type
    pipeline_tag: ClassVar[str | None] = None  # the model card's pipeline tag
    held_out_name: ClassVar[str] = "held-out training rows"  # the model card's name for the validation data
    # the model predicts the next token: recall facts in the text, next-token distillation and retrieval-head
    # calibration need it
    language_model: ClassVar[bool] = False
    # submodules the loss never reads (e.g. BERT's pooler under mean pooling): they stay frozen in every stage, so
    # that DistributedDataParallel does not wait for gradients that never come
    unused_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, context: RunContext) -> None:
        self.context = context  # the run's config, device, tokenizer, model and data

    @property
    def trainer(self) -> RunContext:
        raise AttributeError(f"{type(self).__name__}.trainer: a task gets the run's context as `self.context` "
                             "(hf_kernel_attn.training.RunContext: config, device, tokenizer, model, data), not the "
                             "trainer")

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> str | None:
        """A problem with ``config`` for this task (an error message), or None."""
        return None

    def model_kwargs(self) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (a classification head's labels)."""
        return {}

    def load_data(self) -> tuple[Any, Any]:
        """(training split, held-out split)."""
        raise NotImplementedError

    def batch(self, items: Any, idx: list[int]) -> tuple[dict[str, Any], int]:
        """Model inputs (and targets) for samples ``idx`` of ``items``, and their number of real tokens."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The task loss of ``model`` (the prepared training model) on ``batch``."""
        raise NotImplementedError

    def validate(self, model: torch.nn.Module, rows: Any, batch_size: int) -> dict[str, float]:
        """Held-out scores (``val_*``) of ``model`` on ``rows``."""
        raise NotImplementedError

    def calibration_batch(self, rows: Any) -> dict[str, Any]:
        """Model inputs for held-out ``rows`` (the automatic layer and head choices measure on them)."""
        batch, _ = self.batch(rows, list(range(len(rows))))
        return self.inputs(batch)

    def before_training(self) -> None:
        """Work done once before the first stage (targets computed with the original model)."""

    def save_extras(self, source: Path, target: Path) -> None:
        """Files the converted model folder ``target`` needs besides the model and tokenizer (from ``source``)."""

    def inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The model inputs of ``batch``."""
        return {k: v for k, v in batch.items() if k not in self.extra_keys and k != "num_tokens"}


TASK_TYPES: Registry[type[TrainingTask]] = Registry("training task", TrainingTask)
