"""The chunked causal form.

* :func:`scan` — the causal workhorse: exact quadratic form inside chunks of ``chunk_size`` positions,
  a running state across chunks (updated in place), never an N×N matrix. The denominator rides along
  as an extra all-ones value column, so one matmul gives both.
* :func:`causal_chunked` — :func:`scan` on whole feature tensors, differentiable through
  :class:`CausalScan`, whose backward is three more scans (gradients of causal linear attention are
  causal/anti-causal linear attentions themselves), so nothing N-sized is saved beyond the inputs.

Shapes: ``fq`` ``[B, Hkv, G, N, F]`` (query heads grouped by KV head), ``fk`` ``[B, Hkv, M, F]``,
``v`` ``[B, Hkv, M, Dv]``. A decay (fixed or data-dependent) is the gated engine's (:mod:`.gated`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..base import accum
from .state import LinearState, query_rows, with_ones

DEFAULT_CHUNK = 64


def chunk_mask(length: int, gq: int, gk: int, dtype: torch.dtype, device: torch.device,
               reverse: bool = False) -> torch.Tensor:
    """``[L·gq, L·gk]``: 1 where key row (t', g') is visible to query row (t, g) of one chunk of ``length``
    positions (t' ≤ t; t' ≥ t when ``reverse``), rows ordered (position, group)."""
    idx = torch.arange(length, device=device)
    visible = idx[:, None] >= idx[None, :] if not reverse else idx[:, None] <= idx[None, :]
    return visible.to(dtype).repeat_interleave(gq, 0).repeat_interleave(gk, 1)


@dataclasses.dataclass
class ClosedForm:
    """A kernel with φ(q)·φ(k) = fn(q'·k') for cheaper vectors q', k' (rows as in :func:`scan`);
    ``key_weight`` ``[BH, N·gk]`` (0 for padded keys) multiplies the scores' columns."""

    q: torch.Tensor
    k: torch.Tensor
    fn: Callable[[torch.Tensor], torch.Tensor]
    key_weight: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """How :func:`scan` reads its rows and walks them: ``gq`` query rows and ``gk`` key rows per position (rows
    ordered (position, group)), chunks of ``chunk_size`` positions, and backwards in time when ``reverse``."""

    gq: int = 1
    gk: int = 1
    chunk_size: int = DEFAULT_CHUNK
    reverse: bool = False


def scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    layout: ScanLayout,
    *,
    closed_form: ClosedForm | None = None,
) -> torch.Tensor:
    """Causal linear attention in 3-D layout; updates ``state`` in place to the state after the last key.

    ``q`` ``[BH, N·gq, a]``, ``k`` ``[BH, N·gk, a]``, ``v`` ``[BH, N·gk, b]``, ``state`` ``[BH, a, b]``,
    rows ordered (position, group) (``layout``); returns ``o`` ``[BH, N·gq, b]`` with
    o_(t,g) = Σ_{t' ≤ t, g'} (q_(t,g)·k_(t',g')) v_(t',g') + q_(t,g) state.

    With ``closed_form`` the in-chunk scores q·k come from ``closed_form.fn(q' k'ᵀ)`` on the (smaller)
    ``closed_form.q`` / ``.k`` instead of the features (Taylor: 1 + t + t²/2 from D-dim dot products).

    ``layout.reverse`` runs the same recurrence backwards in time (anti-causal): o_(t,g) sums t' ≥ t, plus
    q state; equal to flipping the positions of every input, scanning and
    flipping back, without the copies. Chunks are then aligned to the end of the sequence.
    """
    gq, gk, reverse = layout.gq, layout.gk, layout.reverse
    n = k.shape[1] // gk
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    chunk = min(layout.chunk_size, n)
    mask = chunk_mask(chunk, gq, gk, q.dtype, q.device, reverse) if n else None
    if reverse:
        starts = [(max(0, end - chunk), min(chunk, end)) for end in range(n, 0, -chunk)]
    else:
        starts = [(start, min(chunk, n - start)) for start in range(0, n, chunk)]
    for start, length in starts:
        if length != chunk:
            mask = chunk_mask(length, gq, gk, q.dtype, q.device, reverse)
        qc = q[:, start * gq:(start + length) * gq]
        kc = k[:, start * gk:(start + length) * gk]
        vc = v[:, start * gk:(start + length) * gk]
        if closed_form is None:
            scores = torch.bmm(qc, kc.transpose(1, 2))
        else:
            scores = closed_form.fn(torch.bmm(closed_form.q[:, start * gq:(start + length) * gq],
                                              closed_form.k[:, start * gk:(start + length) * gk].transpose(1, 2)))
            if closed_form.key_weight is not None:
                scores.mul_(closed_form.key_weight[:, None, start * gk:(start + length) * gk])
        scores.mul_(mask)
        oc = torch.bmm(qc, state)
        oc.baddbmm_(scores, vc)
        out[:, start * gq:(start + length) * gq] = oc
        state.baddbmm_(kc.transpose(1, 2), vc)
    return out


class CausalScan(torch.autograd.Function):
    """:func:`scan` with a recomputing backward. With o = scan(q, k, v; S₀) and S_N its final state:

    * dq = scan(do, v, k; S₀ᵀ)  (causal);
    * dk = scan(v, do, q; dS_Nᵀ) and dv = scan(k, q, do; dS_N), both run in reverse (anti-causal);
    * dS₀ = Σ_t q_tᵀ do_t + dS_N.
    """

    @staticmethod
    def forward(ctx, q, k, v, state0, gq, chunk_size):
        state = state0.clone()
        out = scan(q, k, v, state, ScanLayout(gq, 1, chunk_size))
        ctx.save_for_backward(q, k, v, state0)
        ctx.gq, ctx.chunk_size = gq, chunk_size
        return out, state

    @staticmethod
    def backward(ctx, d_out, d_state):
        with torch.autocast(d_out.device.type, enabled=False):  # a backward run inside an autocast region
            return CausalScan._backward(ctx, d_out, d_state)

    @staticmethod
    def _backward(ctx, d_out, d_state):
        q, k, v, state0 = ctx.saved_tensors
        gq, chunk = ctx.gq, ctx.chunk_size
        forward = ScanLayout(gq, 1, chunk)
        backward = ScanLayout(1, gq, chunk, reverse=True)
        d_state_in = d_state
        dq = dk = dv = ds0 = None
        if ctx.needs_input_grad[0]:
            dq = scan(d_out, v, k, state0.transpose(1, 2).clone(memory_format=torch.contiguous_format), forward)
        if ctx.needs_input_grad[1]:
            dk = scan(v, d_out, q, d_state_in.transpose(1, 2).clone(memory_format=torch.contiguous_format), backward)
        if ctx.needs_input_grad[2]:
            dv = scan(k, q, d_out, d_state_in.clone(memory_format=torch.contiguous_format), backward)
        if ctx.needs_input_grad[3]:
            ds0 = q.transpose(1, 2) @ d_out + d_state
        return dq, dk, dv, ds0, None, None


def causal_chunked(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    state: LinearState | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, LinearState]:
    """Causal numerator ``[B, H, G, N, Dv]`` and denominator ``[B, H, G, N]`` for N queries aligned with
    N keys that follow the keys already folded into ``state``; returns the final state too.
    Differentiable in every input, the state included."""
    fq, fk, v = accum(fq), accum(fk), accum(v)
    b, h, g, n, f = fq.shape
    dv = v.shape[-1]
    if state is None:
        state = LinearState.zeros(fk, dv)
    v3 = with_ones(v).reshape(b * h, n, dv + 1)
    out, s_aug = CausalScan.apply(query_rows(fq), fk.reshape(b * h, n, f), v3, state.augmented(), g, chunk_size)
    out = out.view(b, h, n, g, dv + 1).transpose(2, 3)
    return out[..., :dv], out[..., dv], LinearState.from_augmented(s_aug, b)
