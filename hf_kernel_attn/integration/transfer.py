"""Attention transfer inside the dispatcher (Hedgehog, Zhang et al. ICLR 2024; LoLCATs, Zhang et al. ICLR 2025).

Inside :func:`attention_transfer`, every layer that runs a non-softmax kernel computes, on the *same*
q, k, v, the model's own softmax attention (the teacher, no gradient) and its kernel's output (the
student), records the layer-local loss

    L_l = mean_{b, i, h, c} (y_kernel - y_softmax)²        (LoLCATs' output MSE)

and returns the teacher's output, so every later layer sees exactly the original model's
activations and each layer's loss depends only on that layer's kernel parameters. Nothing else of
the network needs a backward pass, and the caller can skip the LM head.

Inside :func:`softmax_teacher`, every layer runs softmax instead of its kernel: the original model's
attention, used as the teacher of whole-model objectives (e.g. sentence-embedding distillation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..kernels import SOFTMAX, Kernel, LayerShape, build_kernel

TRANSFER_LOSSES = ("mse",)


class AttentionTransfer:
    """Collects the per-layer transfer losses of one forward pass."""

    def __init__(self, loss: str = "mse") -> None:
        if loss not in TRANSFER_LOSSES:
            raise ValueError(f"unknown transfer loss {loss!r}; valid: {list(TRANSFER_LOSSES)}")
        self.loss = loss
        self.losses: list[torch.Tensor] = []
        self.layers: list[int] = []  # the attention layer of each loss
        self.head_losses: list[torch.Tensor] = []  # per layer: the loss of each query head ``[Hq]``, detached

    def total(self) -> torch.Tensor:
        """Σ_l L_l (each layer's parameters get only their own layer's gradient)."""
        if not self.losses:
            raise ValueError(
                "attention transfer recorded no layer: the model has no trainable non-softmax kernel layer "
                "(all layers run softmax, or the forward did not go through hf_kernel_attn)"
            )
        return torch.stack(self.losses).sum()

    def mean(self) -> float:
        return float(torch.stack([x.detach() for x in self.losses]).mean()) if self.losses else float("nan")

    def clear(self) -> None:
        self.losses.clear()
        self.layers.clear()
        self.head_losses.clear()

    def step(self, kernel: Kernel, q, k, v, *, key_mask, causal: bool, scaling: float | None) -> torch.Tensor:
        q, k, v = q.detach(), k.detach(), v.detach()
        with torch.no_grad():
            teacher = _softmax_for(kernel.shape)(q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
        with torch.enable_grad():
            student = kernel(q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
            diff = (student.float() - teacher.float()).pow(2)  # [B, N, H, Dv]
            if key_mask is not None and q.shape[-2] == k.shape[-2]:
                rows = key_mask.to(diff.dtype)[:, :, None, None]  # pad queries carry no signal
                loss = (diff * rows).sum() / (rows.sum() * diff.shape[2] * diff.shape[3]).clamp_min(1)
                per_head = (diff.detach() * rows).sum((0, 1, 3)) / (rows.sum() * diff.shape[3]).clamp_min(1)
            else:
                loss = diff.mean()
                per_head = diff.detach().mean((0, 1, 3))
        self.losses.append(loss)
        self.head_losses.append(per_head)
        self.layers.append(kernel.shape.layer_idx)
        return teacher


_state: dict[str, object] = {"transfer": None, "softmax": False, "probe": None}
_SOFTMAX: dict[LayerShape, Kernel] = {}


def _softmax_for(shape: LayerShape) -> Kernel:
    if shape not in _SOFTMAX:
        _SOFTMAX[shape] = build_kernel(SOFTMAX, shape)
    return _SOFTMAX[shape]


def active_transfer() -> AttentionTransfer | None:
    return _state["transfer"]  # type: ignore[return-value]


def teacher_kernel(kernel: Kernel) -> Kernel:
    """The kernel to run now: softmax inside :func:`softmax_teacher`, else ``kernel`` itself."""
    return _softmax_for(kernel.shape) if _state["softmax"] else kernel


@contextlib.contextmanager
def attention_transfer(loss: str = "mse") -> Iterator[AttentionTransfer]:
    """Record layer-local transfer losses (and pass the softmax outputs on) for forwards run inside."""
    if _state["transfer"] is not None:
        raise RuntimeError("attention_transfer() is already active")
    recorder = AttentionTransfer(loss)
    _state["transfer"] = recorder
    try:
        yield recorder
    finally:
        _state["transfer"] = None


def active_probe() -> Callable[..., None] | None:
    return _state["probe"]  # type: ignore[return-value]


@contextlib.contextmanager
def attention_probe(callback: Callable[..., None]) -> Iterator[None]:
    """Inside this block every hf_kernel_attn attention call first runs
    ``callback(layer_idx, query [B, Hq, N, D], key [B, Hkv, M, D], key_mask, causal, scaling, value=[B, Hkv, M,
    Dv])`` (detached inputs), e.g. to measure attention patterns; the forward itself is unchanged."""
    if _state["probe"] is not None:
        raise RuntimeError("attention_probe() is already active")
    _state["probe"] = callback
    try:
        yield
    finally:
        _state["probe"] = None


@contextlib.contextmanager
def softmax_teacher() -> Iterator[None]:
    """Every kernel layer runs the model's original softmax attention inside this block."""
    previous = _state["softmax"]
    _state["softmax"] = True
    try:
        yield
    finally:
        _state["softmax"] = previous
