"""Gated feature-map kernels (kind ``gated``): a feature map φ plus a per-token gate α_t ∈ (0, 1] per key feature,
evaluated by :mod:`..linear.gated` (every form of the other feature maps: bidirectional, chunked causal, recurrent
decoding, the ``window=W`` hybrid with or without sinks, exact softmax heads), as every kernel with a decay is.

Gates are computed from the layer's (RoPE-rotated) keys through the norms of their rotation pairs,
ρ_{t,i} = ||(k_{t,i}, k_{t,i+D/2})|| (transformers' rotate_half pairing; ``rope_pairs="interleaved"`` for
(k_{t,2i}, k_{t,2i+1})), which RoPE leaves unchanged, so a gate does not depend on where the token sits.
Subclasses define :meth:`GatedKernel.log_gate`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import nn

from ..base import integer_in, number_in, option
from ..linear.gated import GATED_CHUNK, MAX_CHUNK_LOG_RANGE, MIN_LOG_GATE
from .base import LinearKernel, LinearOptions


@dataclasses.dataclass
class GatedOptions(LinearOptions):
    chunk_size: int = option(GATED_CHUNK, "positions per chunk of the gated scan (at most 64: the in-chunk "
                                          "decay factors stay finite in fp32)")
    rope_pairs: str = option("half", "RoPE's rotation pairs: half = (i, i + D/2) (transformers' rotate_half), "
                                     "interleaved = (2i, 2i+1)")

    def validate(self) -> None:
        super().validate()
        if self.rope_pairs not in ROPE_PAIRS:
            raise ValueError(f"rope_pairs={self.rope_pairs!r}: choose one of {', '.join(ROPE_PAIRS)} (how the model's "
                             "RoPE pairs the coordinates it rotates together)")
        if self.chunk_size * -MIN_LOG_GATE > MAX_CHUNK_LOG_RANGE:
            raise ValueError(f"chunk_size={self.chunk_size}: gated kernels need chunk_size <= "
                             f"{int(MAX_CHUNK_LOG_RANGE // -MIN_LOG_GATE)} (the in-chunk factors e^(b0 - b_j) stay "
                             "finite in fp32)")


ROPE_PAIRS = ("half", "interleaved")


def rope_halves(x: torch.Tensor, rope_pairs: str) -> torch.Tensor:
    """The coordinates reordered so that RoPE's rotation pairs are (i, i + P), P = ⌈D/2⌉: unchanged for "half"
    (transformers' rotate_half), [x_0, x_2, …, x_1, x_3, …] for "interleaved" (rotate_every_two)."""
    return x if rope_pairs == "half" else torch.cat([x[..., 0::2], x[..., 1::2]], -1)


def pair_norms(h: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` (ordered by :func:`rope_halves`) -> ``[..., ⌈D/2⌉]``: ρ_i = ||(h_i, h_{i+P})||, the norm of each
    rotation pair, which RoPE leaves unchanged (the middle coordinate alone for odd D)."""
    if h.shape[-1] % 2:
        h = torch.nn.functional.pad(h, (0, 1))
    half = h.shape[-1] // 2
    a, b = h[..., :half], h[..., half:]
    if torch.is_grad_enabled() and h.requires_grad:  # clamped: the gradient of the norm at 0 is finite
        return (a.square() + b.square()).clamp_min(1e-12).sqrt()
    return a.square().add_(b.square()).clamp_min_(1e-12).sqrt_()  # the same numbers in fewer buffers


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(x, -1)`` written over ``x`` (no autograd; bit for bit the same numbers, so that a forward
    without autograd, as in reentrant checkpointing, equals the one with it)."""
    return torch._softmax(x, -1, False, out=x)


MAX_GATE_RANK = 1024  # the gate maps ⌈D/2⌉ pair norms to F gates: a rank past D/2 (or F) adds nothing


def check_low_rank_gate(rank: object, temperature: object) -> None:
    """The low-rank gate's options (GLA, Gated DeltaNet): rank an integer > 0, temperature τ a number > 0."""
    integer_in("gate_rank", rank, 1, MAX_GATE_RANK)
    number_in("gate_temperature", temperature, 0.0, 1e4, low_open=True)


def clamp_log_gate(log_gate: torch.Tensor) -> torch.Tensor:
    """log α clamped at ``MIN_LOG_GATE`` (in place without autograd): the gates every gated form runs on."""
    if torch.is_grad_enabled() and log_gate.requires_grad:
        return log_gate.clamp_min(MIN_LOG_GATE)
    return log_gate.clamp_min_(MIN_LOG_GATE)


def low_rank_log_gate(k: torch.Tensor, scaling: float, rope_pairs: str, down: torch.Tensor, up: torch.Tensor,
                      bias: torch.Tensor, temperature: float) -> torch.Tensor:
    """GLA's learnable low-rank gate (Yang et al., ICML 2024) from the keys ``[B, Hkv, M, D]``:
    log α_t = log σ(s^1/2 ρ_t W₁ W₂ + β) / τ ``[B, Hkv, M, Γ]``, ρ_t the RoPE-pair norms of k_t (W₁ = ``down``
    ``[Hkv, ⌈D/2⌉, r]``, W₂ = ``up`` ``[Hkv, r, Γ]``, β = ``bias`` ``[Hkv, Γ]``, τ = ``temperature``)."""
    rho = pair_norms(rope_halves(k, rope_pairs)) * math.sqrt(scaling)  # [B, H, M, P]
    dtype = rho.dtype
    logits = rho @ down.to(dtype)[None] @ up.to(dtype)[None]
    if torch.is_grad_enabled() and logits.requires_grad:
        return nn.functional.logsigmoid(logits + bias.to(dtype)[None, :, None]) / temperature
    logits.add_(bias.to(dtype)[None, :, None])
    return nn.functional.logsigmoid(logits).div_(temperature)


def reset_low_rank_gate(down: torch.Tensor, up: torch.Tensor, bias: torch.Tensor, layer_idx: int) -> None:
    """The low-rank gate's initialisation: W₁ random (deterministic per layer), W₂ = 0 and β = 4, so every gate starts
    at α = σ(4)^(1/τ) (≈ 0.999 for τ = 16) and training learns them."""
    gen = torch.Generator().manual_seed(1_000_003 + layer_idx)
    with torch.no_grad():
        down.copy_(torch.randn(down.shape, generator=gen) / math.sqrt(down.shape[1]))
        up.zero_()
        bias.fill_(4.0)


class GatedKernel(LinearKernel):
    """φ(q)·φ(k) weighted by e^{b_i - b_j} (b the running sum of log α) instead of a fixed decay; see
    :mod:`.gated` for the forms."""
    supports_sparse_cache: ClassVar[bool] = False  # a decayed state cannot give a pair back exactly

    kind: ClassVar[str] = "gated"
    options_cls = GatedOptions

    def log_gate(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """log α_t ≤ 0 ``[B, Hkv, M, Γ]`` from the keys ``[B, Hkv, M, D]``: Γ = F (one gate per feature), Γ = 1
        (one per head) or any Γ dividing F, gate i covering every feature f ≡ i (mod Γ) (fewer gates are
        cheaper)."""
        raise NotImplementedError

    def gates(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        return clamp_log_gate(self.log_gate(k.float() if k.dtype != torch.float64 else k, scaling))
