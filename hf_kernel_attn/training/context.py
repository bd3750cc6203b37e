"""What a training stage or task sees of a conversion run: :class:`RunContext`.

A stage computes a loss and a task reads data and scores a model; neither needs the loop, the accelerator, the
checkpoints or the other stages. The run hands them this object instead of its trainer: the config, the device,
the tokenizer, the model (the one a step runs, and the one being converted), the data, and the original model on
request. The trainer owns the object and keeps it current (:mod:`.model_setup` swaps the model when LoRA adapters go
in or are merged; the loop sets :attr:`RunContext.net` while a stage steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RunContext:
    """A run's shared state, as stages and tasks see it."""

    config: dict[str, Any]
    device: torch.device
    tokenizer: Any = None  # a transformers tokenizer, once the model is loaded
    model: torch.nn.Module | None = None  # the model being converted (a peft wrapper while adapters are in)
    net: torch.nn.Module | None = None  # while a stage steps: the prepared model (DDP-wrapped, autocast)
    forward_kwargs: frozenset[str] = frozenset()  # the names the model's forward takes
    train: Any = None  # the training split (``.items``: what the task's load_data returned)
    valid: Any = None  # the held-out split
    plan: Any = None  # the batch plan (:class:`.data.BatchPlan`): which samples each global batch reads
    load_original: Callable[[], torch.nn.Module] | None = field(default=None, repr=False)

    def student(self) -> torch.nn.Module:
        """The model a training step runs: during a stage the prepared one, else the model."""
        return self.net if self.net is not None else self.model

    def is_peft(self) -> bool:
        """Whether LoRA adapters are in (the model is a peft wrapper)."""
        return type(self.model).__module__.startswith("peft")

    def base_model(self) -> torch.nn.Module:
        """The transformers model under the adapters (the model itself when there are none)."""
        return self.model.get_base_model() if self.is_peft() else self.model

    def load_original_model(self) -> torch.nn.Module:
        """The model as it was before the run: softmax attention, the original weights (a distillation teacher)."""
        if self.load_original is None:
            raise RuntimeError("the original model can be loaded only once the run has loaded its model")
        return self.load_original()

    def encode(self, texts_a: list[str], texts_b: list[str | None] | None = None) -> dict[str, torch.Tensor]:
        """Tokenized ``texts_a`` (with ``texts_b`` as second segments where given), padded and truncated to
        ``data.seq_len``, on the run's device."""
        seq_len = self.config["data"]["seq_len"]
        if texts_b is not None and any(t is not None for t in texts_b):
            enc = self.tokenizer(texts_a, [t or "" for t in texts_b], padding=True, truncation=True,
                                 max_length=seq_len, return_tensors="pt")
        else:
            enc = self.tokenizer(texts_a, padding=True, truncation=True, max_length=seq_len, return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask",
                                                                      "token_type_ids")}
