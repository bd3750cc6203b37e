"""Automatic per-layer kernel choice: ``layers="auto:K"`` keeps as softmax the K attention layers whose kernel
is furthest from softmax on calibration text, and converts the rest; ``heads="auto:K"`` (training) keeps the K
query heads furthest from softmax, over the whole model, as exact softmax heads inside their converted layers
(the kernel option ``softmax_heads``).

A layer's error is its attention-transfer loss (integration/transfer.py, LoLCATs' layer-local output MSE):
mean (y_kernel - y_softmax)² over the calibration tokens, with every layer fed the original model's
activations, so the errors of different layers are measured on the same inputs and do not compound.
The choice and the errors are recorded in ``config.kernel_attention["auto"]``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..config import KernelAttentionConfig, LayerChoice
from ..kernels import SOFTMAX
from .attention import KERNEL_ATTR
from .modules import num_attention_layers
from .patching import apply_config, kernel_config
from .transfer import attention_probe, attention_transfer, softmax_teacher

logger = logging.getLogger("hf_kernel_attn")
AUTO_PREFIX = "auto:"


def parse_auto(layers: Any, num_layers: int | None = None) -> int | None:
    """K for ``layers="auto:K"``; None for any other (non-string) ``layers``; a ValueError for a bad string."""
    if not isinstance(layers, str):
        return None
    count = layers[len(AUTO_PREFIX):] if layers.startswith(AUTO_PREFIX) else None
    if count is None or not count.isdigit():
        raise ValueError("layers must be None, a list of layer indices, a dict {index: kernel} or 'auto:K' (K = how "
                         f"many layers stay softmax, an integer >= 0), got {layers!r}")
    k = int(count)
    if num_layers is not None and k > num_layers:
        raise ValueError(f"layers={layers!r}: cannot keep {k} layers as softmax, the model has {num_layers} "
                         "attention layers")
    return k


def _as_batches(calibration: Any) -> list[dict[str, Any]]:
    """Model-input dicts from a tensor of token ids ``[B, N]``, a dict (e.g. a tokenizer's output) or a list."""
    if isinstance(calibration, torch.Tensor):
        if calibration.dim() != 2 or calibration.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
            raise ValueError(f"calibration token ids must be an integer tensor [batch, tokens], got "
                             f"{calibration.dtype} {tuple(calibration.shape)}")
        return [{"input_ids": calibration}]
    if isinstance(calibration, dict) or hasattr(calibration, "keys"):
        if "input_ids" not in calibration and "inputs_embeds" not in calibration:
            raise ValueError(f"calibration inputs need input_ids; got keys {sorted(calibration.keys())}")
        return [dict(calibration)]
    if isinstance(calibration, (list, tuple)) and calibration:
        return [b for item in calibration for b in _as_batches(item)]
    raise ValueError(
        "layers='auto:K' needs calibration text: calibration= token ids [batch, tokens], a dict of model inputs "
        f"(e.g. tokenizer(text, return_tensors='pt')) or a list of them; got {type(calibration).__name__}"
    )


@torch.no_grad()
def _recorded_losses(model: nn.Module, calibration: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, transfer loss, per-head losses ``[Hq]``) of every layer that runs a non-softmax kernel, for every
    calibration batch, in eval mode (restored afterwards)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for batch in _as_batches(calibration):
            inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            inputs.update(_cheap_forward_kwargs(model))
            with attention_transfer() as rec:
                model(**inputs)
                found = list(zip(rec.layers, rec.losses, rec.head_losses, strict=True))
            yield from found
    finally:
        model.train(was_training)


def transfer_errors(model: nn.Module, calibration: Any | Iterable[dict[str, Any]]) -> dict[int, float]:
    """Per attention layer that runs a non-softmax kernel: its mean transfer loss over the calibration batches."""
    totals: dict[int, float] = {}
    counts: dict[int, int] = {}
    for layer, loss, _ in _recorded_losses(model, calibration):
        totals[layer] = totals.get(layer, 0.0) + float(loss.detach())
        counts[layer] = counts.get(layer, 0) + 1
    return {layer: totals[layer] / counts[layer] for layer in sorted(totals)}


def _cheap_forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """No cache, and one position of the LM head: only the attention layers' losses are wanted."""
    import inspect

    names = inspect.signature(type(model).forward).parameters
    out: dict[str, Any] = {}
    if "use_cache" in names:
        out["use_cache"] = False
    if "logits_to_keep" in names:
        out["logits_to_keep"] = 1
    return out


def choose_softmax_layers(errors: dict[int, float], k: int) -> list[int]:
    """The K layers with the largest errors (ties: the lower index), in index order."""
    ranked = sorted(errors, key=lambda layer: (-errors[layer], layer))
    return sorted(ranked[:k])


def apply_choice(model: nn.Module, kernel: str, params: dict[str, Any], softmax_layers: list[int],
                 record: dict[str, Any]) -> nn.Module:
    """Keep ``softmax_layers`` as softmax and every other layer on ``kernel``; layers that keep their kernel keep
    its (possibly trained) parameters. ``record`` goes to ``config.kernel_attention["auto"]``."""
    kcfg = KernelAttentionConfig.create(kernel, {i: SOFTMAX for i in softmax_layers},
                                        num_layers=num_attention_layers(model), **params)
    kcfg.auto = record
    return apply_config(model, kcfg)


def measure_choice(model: nn.Module, k: int, calibration: Any) -> dict[str, Any]:
    """The record of an automatic choice on a model whose layers all run their kernel: every layer's transfer
    error on the calibration batches, and the K largest kept as softmax."""
    batches = _as_batches(calibration)
    errors = transfer_errors(model, batches)
    return {"keep_softmax": k, "softmax_layers": choose_softmax_layers(errors, k),
            "errors": {str(i): e for i, e in errors.items()},
            "calibration_tokens": sum(int(b["input_ids"].numel()) for b in batches if "input_ids" in b)}


def auto_patch(model: nn.Module, kernel: str, k: int, calibration: Any, **params: Any) -> nn.Module:
    """``patch(model, kernel, layers="auto:K", calibration=...)``: convert every layer, measure each layer's
    transfer error on the calibration batches, then put the K worst layers back to softmax."""
    _as_batches(calibration)  # a bad calibration fails before the model is touched
    apply_config(model, KernelAttentionConfig.create(kernel, None, num_layers=num_attention_layers(model), **params))
    record = measure_choice(model, k, calibration)
    apply_choice(model, kernel, params, record["softmax_layers"], record)
    logger.info("layers=auto:%d: keeping layers %s as softmax (transfer errors %s)", k, record["softmax_layers"],
                {i: f"{record['errors'][str(i)]:.3g}" for i in record["softmax_layers"]})
    return model


# ------------------------------------------------------------------------------------------ per-head choice
def head_transfer_errors(model: nn.Module, calibration: Any) -> dict[int, list[float]]:
    """Per attention layer that runs a non-softmax kernel: the mean transfer loss of each query head over the
    calibration batches (the layer loss of :func:`transfer_errors`, split by head)."""
    totals: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for layer, _, per_head in _recorded_losses(model, calibration):
        totals[layer] = totals.get(layer, 0) + per_head.double().cpu()
        counts[layer] = counts.get(layer, 0) + 1
    return {layer: (totals[layer] / counts[layer]).tolist() for layer in sorted(totals)}


def choose_softmax_heads(errors: dict[int, list[float]], k: int, group: int = 1) -> dict[int, list[int]]:
    """The K (layer, head) pairs with the largest errors (or scores) over the whole model (ties: lower layer, then
    head), as {layer: sorted heads}. With ``group`` > 1 (query heads per KV head), K counts KV heads: the K
    groups whose best query head scores highest, each with all of its query heads (they share one K/V cache)."""
    if group > 1:
        grouped = {layer: [max(row[g * group:(g + 1) * group]) for g in range(len(row) // group)]
                   for layer, row in errors.items()}
        return {layer: sorted(h for g in groups for h in range(g * group, (g + 1) * group))
                for layer, groups in choose_softmax_heads(grouped, k).items()}
    pairs = [(layer, head) for layer, row in errors.items() for head in range(len(row))]
    ranked = sorted(pairs, key=lambda p: (-errors[p[0]][p[1]], p[0], p[1]))[:k]
    chosen: dict[int, list[int]] = {}
    for layer, head in ranked:
        chosen.setdefault(layer, []).append(head)
    return {layer: sorted(heads) for layer, heads in sorted(chosen.items())}


HEAD_CRITERIA = ("auto", "retrieval")


def parse_heads(heads: Any) -> tuple[str, int]:
    """``"auto:K"`` (transfer error) or ``"retrieval:K"`` (the teacher's attention on recalled facts) -> (criterion,
    K); a ValueError naming the valid forms otherwise."""
    criterion, _, count = heads.partition(":") if isinstance(heads, str) else ("", "", "")
    if criterion not in HEAD_CRITERIA or not count.isdigit() or int(count) < 1:
        raise ValueError(f"heads must be null, 'auto:K' (the K query heads with the largest transfer error) or "
                         f"'retrieval:K' (the K heads that attend most to recalled facts), K an integer >= 1; got "
                         f"{heads!r}")
    return criterion, int(count)


def measure_head_choice(model: nn.Module, k: int, calibration: Any, group: int = 1) -> dict[str, Any]:
    """The record of an automatic head choice (``heads="auto:K"``): every converted head's transfer error on the
    calibration batches and the K largest (K KV-head groups with ``group`` > 1), to be kept as exact softmax."""
    batches = _as_batches(calibration)
    errors = head_transfer_errors(model, batches)
    _check_head_count(errors, k, group, "auto")
    return {"keep_softmax_heads": k, "head_criterion": "auto", "head_group": group,
            "softmax_heads": {str(i): h for i, h in choose_softmax_heads(errors, k, group).items()},
            "head_errors": {str(i): row for i, row in errors.items()},
            "head_calibration_tokens": sum(int(b["input_ids"].numel()) for b in batches if "input_ids" in b)}


def _check_head_count(scores: dict[int, list[float]], k: int, group: int, criterion: str) -> None:
    total = sum(len(row) for row in scores.values()) // group
    unit = "KV heads" if group > 1 else "heads"
    if k > total:
        raise ValueError(f"heads='{criterion}:{k}': cannot keep {k} {unit} as softmax, the converted layers have "
                         f"{total}")


def _kernels(model: nn.Module) -> list[Any]:
    return [m.kernel_attn for m in model.modules() if getattr(m, KERNEL_ATTR, None) is not None]


def kv_group_size(model: nn.Module) -> int:
    """Query heads per KV head in the model's kernel layers (1 without grouped-query attention)."""
    kernels = _kernels(model)
    if not kernels:
        raise ValueError("a head choice needs a model patched with hf_kernel_attn")
    return kernels[0].shape.num_heads // kernels[0].shape.num_kv_heads


def measure_retrieval_head_choice(model: nn.Module, k: int, batches: list[dict[str, Any]],
                                  targets: list[list[list[tuple[int, ...]]]], group: int = 1) -> dict[str, Any]:
    """The record of ``heads="retrieval:K"``: every converted head's retrieval score
    (:func:`head_retrieval_scores` of the softmax teacher on ``targets``) and the K highest (K KV-head groups
    with ``group`` > 1), to be kept as exact softmax."""
    converted = {kernel.shape.layer_idx for kernel in _kernels(model) if kernel.is_linear}
    scores = {layer: row for layer, row in head_retrieval_scores(model, batches, targets).items()
              if layer in converted}
    _check_head_count(scores, k, group, "retrieval")
    return {"keep_softmax_heads": k, "head_criterion": "retrieval", "head_group": group,
            "softmax_heads": {str(i): h for i, h in choose_softmax_heads(scores, k, group).items()},
            "head_scores": {str(i): row for i, row in scores.items()},
            "head_calibration_tokens": sum(int(b["input_ids"].numel()) for b in batches if "input_ids" in b)}


def apply_head_choice(model: nn.Module, record: dict[str, Any]) -> nn.Module:
    """Give each chosen layer its ``softmax_heads`` (per-layer options; every other option and the trained
    feature maps stay), and add ``record`` to ``config.kernel_attention["auto"]``."""
    kcfg = kernel_config(model)
    if kcfg is None:
        raise ValueError("a head choice needs a model patched with hf_kernel_attn")
    layers = dict(kcfg.layers)
    for key, heads in record["softmax_heads"].items():
        idx = int(key)
        choice = kcfg.for_layer(idx)
        layers[idx] = LayerChoice(choice.kernel, {**choice.params, "softmax_heads": list(heads)})
    new = KernelAttentionConfig(kcfg.kernel, dict(kcfg.params), layers, {**(kcfg.auto or {}), **record})
    return apply_config(model, new)


@torch.no_grad()
def head_retrieval_scores(model: nn.Module, batches: list[dict[str, Any]],
                          targets: list[list[list[tuple[int, ...]]]], *,
                          teacher: bool = True) -> dict[int, list[float]]:
    """Per attention layer, per query head: the mean softmax attention probability that the original model's
    head puts on a target, P_h(s <= key < e | query = t), over ``targets[batch][row]`` = [(t, s) or
    (t, s, e), ...] (``(t, s)`` = ``(t, s, s + 1)``; e.g. ``training.recall_data.recall_span_targets``). Every
    layer runs its original softmax (``softmax_teacher``), so the scores are the teacher's; a high score marks a
    retrieval head (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").
    ``teacher=False`` scores the model as it runs (the softmax probabilities of its own queries and keys)."""
    totals: dict[int, torch.Tensor] = {}
    count = 0
    current: list[list[tuple[int, int]]] = []

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor, key_mask, causal: bool, scaling, value=None) -> None:
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        scale = scaling if scaling is not None else d ** -0.5
        score = totals.setdefault(layer, torch.zeros(hq, dtype=torch.float64))
        for b, pairs in enumerate(current):
            if not pairs:
                continue
            tq = torch.tensor([p[0] for p in pairs], device=q.device)
            ts = torch.tensor([p[1] for p in pairs], device=q.device)
            te = torch.tensor([p[2] if len(p) > 2 else p[1] + 1 for p in pairs], device=q.device)
            keys = k[b].float().repeat_interleave(hq // hkv, 0)  # [Hq, M, D]
            logits = torch.einsum("htd,hmd->htm", q[b][:, tq].float(), keys) * scale
            cols = torch.arange(keys.shape[1], device=q.device)
            hidden = cols[None, :] > tq[:, None] if causal else torch.zeros_like(logits[0], dtype=torch.bool)
            if key_mask is not None:
                hidden = hidden | ~key_mask[b][None, :]
            probs = logits.masked_fill(hidden, float("-inf")).softmax(-1)
            inside = (cols[None, :] >= ts[:, None]) & (cols[None, :] < te[:, None])  # [T, M]
            score += (probs * inside).sum((-1, -2)).double().cpu()

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for batch, rows in zip(batches, targets, strict=True):
            current[:] = rows
            count += sum(len(r) for r in rows)
            inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            inputs.update(_cheap_forward_kwargs(model))
            with softmax_teacher() if teacher else contextlib.nullcontext(), attention_probe(probe):
                model(**inputs)
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("head retrieval scores need at least one copy target (query, key) pair")
    return {layer: (totals[layer] / count).tolist() for layer in sorted(totals)}
