"""Gated feature-map kernels (kind ``gated``): a feature map φ plus a per-token gate α_t ∈ (0, 1] per key feature,
evaluated by :mod:`..linear.gated` (every form of the other feature maps: bidirectional, chunked causal, recurrent
decoding, the ``window=W`` hybrid, exact softmax heads).

Gates are computed from the layer's (RoPE-rotated) keys through the norms of their rotation pairs,
ρ_{t,i} = ||(k_{t,i}, k_{t,i+D/2})|| (transformers' rotate_half pairing; ``rope_pairs="interleaved"`` for
(k_{t,2i}, k_{t,2i+1})), which RoPE leaves unchanged, so a gate does not depend on where the token sits.
Subclasses define :meth:`GatedKernel.log_gate`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..base import accum, group_queries, ungroup_output
from ..linear.gated import (
    GATED_CHUNK,
    MAX_CHUNK_LOG_RANGE,
    MIN_LOG_GATE,
    cumulative,
    fold,
    gated_causal,
    gated_hybrid,
    gated_linear,
    per_feature,
)
from ..linear.state import LinearState, normalized_output, with_ones
from .base import LinearKernel, LinearOptions, dense


@dataclasses.dataclass
class GatedOptions(LinearOptions):
    chunk_size: int = GATED_CHUNK
    rope_pairs: str = "half"  # RoPE's rotation pairs: (i, i + D/2) ("half", transformers' rotate_half) or (2i, 2i+1)

    def validate(self) -> None:
        super().validate()
        if self.rope_pairs not in ROPE_PAIRS:
            raise ValueError(f"rope_pairs={self.rope_pairs!r}: choose one of {', '.join(ROPE_PAIRS)} (how the model's "
                             "RoPE pairs the coordinates it rotates together)")
        if self.sinks:
            raise ValueError(f"sinks={self.sinks}: gated kernels take a window (window=W) but no sinks yet; set "
                             "sinks=0")
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


class GatedKernel(LinearKernel):
    """φ(q)·φ(k) weighted by e^{b_i - b_j} (b the running sum of log α) instead of a fixed decay; see
    :mod:`.gated` for the forms."""

    kind: ClassVar[str] = "gated"
    options_cls = GatedOptions

    def log_gate(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """log α_t ≤ 0 ``[B, Hkv, M, Γ]`` from the keys ``[B, Hkv, M, D]``: Γ = F (one gate per feature), Γ = 1
        (one per head) or any Γ dividing F, gate i covering every feature f ≡ i (mod Γ) (fewer gates are
        cheaper)."""
        raise NotImplementedError

    def gates(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        log_gate = self.log_gate(k.float() if k.dtype != torch.float64 else k, scaling)
        if torch.is_grad_enabled() and log_gate.requires_grad:
            return log_gate.clamp_min(MIN_LOG_GATE)
        return log_gate.clamp_min_(MIN_LOG_GATE)

    def scores(self, q, k, scaling):
        """κ_ij = Σ_f φ_f(q_i) φ_f(k_j) e^{-|b_{p_i} - b_j|_f} ``[B, Hq, N, M]`` (query i at position M - N + i)."""
        fq, fk = self.features(q, k, scaling)  # [B, H, G, N, F], [B, H, M, F]
        b = per_feature(cumulative(self.gates(k, scaling)), fk.shape[-1])  # [B, H, M, F]
        n, m = q.shape[-2], k.shape[-2]
        bq = b[:, :, m - n:]
        weight = (-(bq[:, :, :, None] - b[:, :, None, :]).abs()).exp()  # [B, H, N, M, F]
        kappa = torch.einsum("bhgnf,bhmf,bhnmf->bhgnm", fq, fk, weight)
        return kappa.flatten(1, 2)

    def _feature_map_with_state(self, q, k, v, key_mask, causal, scaling, state, offset, need_state):
        if causal and not self.window and not self._needs_grad(q, k, v, state):
            return self._gated_causal_blocked(q, k, v, key_mask, scaling, state, offset)
        fq, fk = self.features(q, k, scaling, offset)
        log_gate = self.gates(k, scaling)
        hkv = k.shape[1]
        if self.window:
            out, new_state = gated_hybrid(
                group_queries(q, hkv), k, v, fq, fk, log_gate, window=self.window, scaling=scaling, causal=causal,
                key_mask=key_mask, state=state, log_mix=self.branch_log_mix(hkv, k.device),
                chunk_size=self.options.chunk_size)
            return ungroup_output(out).to(q.dtype), new_state
        num, den, new_state = gated_linear(fq, fk, v, log_gate, causal=causal, key_mask=key_mask, state=state,
                                           chunk_size=self.options.chunk_size)
        return normalized_output(num, den, self.options.eps).to(q.dtype), new_state

    def _gated_causal_blocked(self, q, k, v, key_mask, scaling, state, offset):
        """The causal forward without autograd, a block of whole chunks at a time: features, gates, the scan (its
        state carried from block to block) and the normalisation per block, so that every temporary stays the
        size of a block (fresh N-sized buffers cost more than the arithmetic in them on CPU). The same numbers as
        :func:`..linear.gated.gated_linear`: chunks start at the same positions and see the same state."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        self.check_positions(offset + m)
        kpos = torch.arange(offset, offset + m, device=q.device)
        s = None if state is None else torch.cat([state.S, state.z.unsqueeze(-1)], -1)
        prefix = m - n
        if prefix > 0:  # keys before the queries: folded into the starting state
            mask = None if key_mask is None else key_mask[:, :prefix]
            fk = self._key_features(k[:, :, :prefix], kpos[:prefix], scaling, mask)
            s = fold(fk, with_ones(accum(v[:, :, :prefix])), self.gates(k[:, :, :prefix], scaling), s)
        out = q.new_empty(b, n, hq, dv)
        chunk = self.options.chunk_size
        block = self._block_length(b * hq)
        for start in range(0, n, block):
            end = min(start + block, n)
            keys = slice(prefix + start, prefix + end)
            mask = None if key_mask is None else key_mask[:, keys]
            fq = self.feature_q(group_queries(dense(q[:, :, start:end]), hkv), kpos[keys], scaling)
            fk = self._key_features(k[:, :, keys], kpos[keys], scaling, mask)
            o, s = gated_causal(fq, fk, with_ones(accum(v[:, :, keys])), self.gates(k[:, :, keys], scaling), s, chunk)
            torch.div(o[..., :dv], o[..., dv:].clamp_min(self.options.eps),
                      out=out[:, start:end].view(b, end - start, hkv, hq // hkv, dv).permute(0, 2, 3, 1, 4))
        if s is None:  # n == 0 and no state
            return out, state
        return out, LinearState(s[..., :dv], s[..., dv])
