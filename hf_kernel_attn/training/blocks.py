"""Conversion building blocks for your own training scripts: a stock ``transformers.Trainer``, TRL's
``SFTTrainer``, or a plain accelerate / PyTorch loop (see ``examples/``).

* :class:`AttentionTransferModel` wraps a patched model so that its forward returns the attention-transfer loss
  (Hedgehog, Zhang et al. ICLR 2024; LoLCATs, Zhang et al. ICLR 2025): Σ_l mean (y_kernel − y_softmax)² with every
  layer fed the original model's activations. Only the kernels' own parameters need training
  (:func:`kernel_parameters`; the wrapper freezes the rest).
* :class:`EmbeddingDistillationModel` wraps an encoder so that its forward returns 1 − cos(mean-pooled embedding,
  the teacher's embedding passed as ``labels``): the second stage of a sentence-embedding conversion;
  :func:`teacher_embeddings` computes the teacher's (softmax) embeddings with the same network.
* :func:`hf_kernel_attn.training.losses.distillation_loss` is the logit-distillation loss of the ``distill``
  stage; ``softmax_teacher()`` runs the same network with its original softmax attention (the teacher).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..evaluation.runner import mean_pool
from ..integration.attention import KERNEL_ATTR
from ..integration.layer_choice import _cheap_forward_kwargs
from ..integration.transfer import attention_transfer, softmax_teacher


def kernel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the model's attention kernels (what attention transfer trains)."""
    out: list[nn.Parameter] = []
    for module in model.modules():
        kernel = getattr(module, KERNEL_ATTR, None)
        if kernel is not None:
            out += [p for p in kernel.parameters() if p.is_floating_point()]
    return out


@dataclasses.dataclass
class TransferOutput(ModelOutput):
    """``loss``: Σ_l L_l; ``layer_losses``: ``[layers]`` (detached)."""

    loss: torch.Tensor | None = None
    layer_losses: torch.Tensor | None = None


class AttentionTransferModel(nn.Module):
    """``model`` (patched with a non-softmax kernel) whose forward returns the attention-transfer loss.

    Every parameter but the kernels' is frozen (``requires_grad=False``), the wrapped model runs in eval mode
    (dropout off, as in LoLCATs' transfer stage), and a causal LM computes a single position of its LM head.
    Train it with any loop; afterwards ``wrapper.model`` is the converted model (``save_pretrained`` it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        params = kernel_parameters(model)
        if not params:
            raise ValueError("AttentionTransferModel needs a model patched with a kernel that has parameters of its "
                             "own (e.g. hedgehog, gaussian, or window_mix=True); this one has none to train")
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        self.config = getattr(model, "config", None)

    def train(self, mode: bool = True) -> AttentionTransferModel:
        super().train(mode)
        self.model.eval()  # the teacher's activations: no dropout in any mode
        return self

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: Any = None, **kwargs: Any) -> TransferOutput:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                  "position_ids": position_ids, **kwargs}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        inputs.pop("num_items_in_batch", None)
        inputs.update(_cheap_forward_kwargs(self.model))
        with attention_transfer() as rec:
            self.model(**inputs)
            loss = rec.total()
            layers = torch.stack([x.detach() for x in rec.losses])
        return TransferOutput(loss=loss, layer_losses=layers)


@torch.no_grad()
def teacher_embeddings(model: nn.Module, batches) -> torch.Tensor:
    """The mean-pooled embeddings of the same network with its original softmax attention, for an iterable of
    tokenizer outputs (dicts with ``input_ids``, ``attention_mask``); ``[rows, hidden]`` fp32."""
    was_training = model.training
    model.eval()
    out = []
    try:
        with softmax_teacher():
            for batch in batches:
                hidden = model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state
                out.append(mean_pool(hidden, batch["attention_mask"]).float())
    finally:
        model.train(was_training)
    return torch.cat(out)


@dataclasses.dataclass
class EmbeddingOutput(ModelOutput):
    """``loss``: mean (1 − cos); ``embeddings``: the student's mean-pooled embeddings ``[B, hidden]``."""

    loss: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None


class EmbeddingDistillationModel(nn.Module):
    """An encoder whose forward returns ``loss`` = mean (1 − cos(mean_pool(hidden), labels)) with ``labels`` the
    teacher's embeddings ``[B, hidden]``, and the student's ``embeddings``. Every parameter trains (full
    fine-tuning); ``wrapper.model`` is the converted encoder."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = getattr(model, "config", None)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> ModelOutput:
        kwargs.pop("num_items_in_batch", None)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        hidden = self.model(**{k: v for k, v in inputs.items() if v is not None}, **kwargs).last_hidden_state
        emb = mean_pool(hidden, attention_mask if attention_mask is not None else torch.ones_like(input_ids))
        loss = None
        if labels is not None:
            loss = (1 - nn.functional.cosine_similarity(emb.float(), labels.float(), dim=-1)).mean()
        return EmbeddingOutput(loss=loss, embeddings=emb)
