"""The chunked causal form.

* :func:`scan` — the causal workhorse: exact quadratic form inside chunks of ``chunk_size`` positions,
  a running state across chunks (updated in place), never an N×N matrix. The denominator rides along
  as an extra all-ones value column, so one matmul gives both.
* :func:`causal_chunked` — :func:`scan` on whole feature tensors, differentiable through
  :class:`CausalScan`, whose backward is three more scans (gradients of causal linear attention are
  causal/anti-causal linear attentions themselves), so nothing N-sized is saved beyond the inputs.

Shapes: ``fq`` ``[B, Hkv, G, N, F]`` (query heads grouped by KV head), ``fk`` ``[B, Hkv, M, F]``,
``v`` ``[B, Hkv, M, Dv]``; ``log_decay`` ``[Hkv]`` (log γ ≤ 0) or None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..base import accum
from .state import LinearState, decay_powers, query_rows, with_ones

DEFAULT_CHUNK = 64


class ChunkTables:
    """Masks and decay factors for one chunk of ``length`` positions with ``gq`` query rows and ``gk``
    key rows per position (rows ordered (position, group)).

    ``intra[h, (t, g), (t', g')]`` = γ_h^(t - t') for t' ≤ t, else 0 (1 instead of γ^· without decay);
    ``q_decay[h, (t, g)]`` = γ^t (how much the state at the chunk start has decayed by query t);
    ``k_decay[h, (t', g')]`` = γ^(length - t') and ``carry[h]`` = γ^length (the state update).
    """

    def __init__(self, log_decay: torch.Tensor | None, length: int, gq: int, gk: int,
                 dtype: torch.dtype, device: torch.device, reverse: bool = False):
        self.length, self.gq, self.gk = length, gq, gk
        if reverse:  # the tables of the time-reversed chunk: every per-position table read backwards
            fwd = ChunkTables(log_decay, length, gq, gk, dtype, device)
            self.intra = fwd.intra.flip(-1, -2)
            self.carry = fwd.carry
            self.q_decay = None if fwd.q_decay is None else fwd.q_decay.flip(-2)
            self.k_decay = None if fwd.k_decay is None else fwd.k_decay.flip(-2)
            return
        idx = torch.arange(length, device=device, dtype=dtype)
        tril = (idx[:, None] >= idx[None, :]).to(dtype)
        if log_decay is None:
            self.intra = tril.repeat_interleave(gq, 0).repeat_interleave(gk, 1)[None]
            self.q_decay = self.k_decay = self.carry = None
            return
        log_decay = log_decay.to(device=device, dtype=dtype)
        intra = decay_powers(log_decay, (idx[:, None] - idx[None, :]).clamp_min(0)) * tril
        self.intra = intra.repeat_interleave(gq, 1).repeat_interleave(gk, 2)  # [H, L·gq, L·gk]
        self.q_decay = decay_powers(log_decay, idx).repeat_interleave(gq, 1).unsqueeze(-1)
        self.k_decay = decay_powers(log_decay, length - idx).repeat_interleave(gk, 1).unsqueeze(-1)
        self.carry = torch.exp(log_decay * length).view(-1, 1, 1)

    def head_view(self, x: torch.Tensor) -> torch.Tensor:
        """``[B·H, r, c]`` -> ``[B, H, r, c]`` so that per-head tables broadcast."""
        heads = self.intra.shape[0]
        return x.view(-1, heads, *x.shape[1:]) if heads > 1 else x


@dataclasses.dataclass
class ClosedForm:
    """A kernel with φ(q)·φ(k) = fn(q'·k') for cheaper vectors q', k' (rows as in :func:`scan`);
    ``key_weight`` ``[BH, N·gk]`` (0 for padded keys) multiplies the scores' columns."""

    q: torch.Tensor
    k: torch.Tensor
    fn: Callable[[torch.Tensor], torch.Tensor]
    key_weight: torch.Tensor | None = None


def scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    *,
    gq: int,
    gk: int,
    log_decay: torch.Tensor | None,
    chunk_size: int = DEFAULT_CHUNK,
    closed_form: ClosedForm | None = None,
    reverse: bool = False,
) -> torch.Tensor:
    """Causal linear attention in 3-D layout; updates ``state`` in place to the state after the last key.

    ``q`` ``[BH, N·gq, a]``, ``k`` ``[BH, N·gk, a]``, ``v`` ``[BH, N·gk, b]``, ``state`` ``[BH, a, b]``,
    rows ordered (position, group); returns ``o`` ``[BH, N·gq, b]`` with
    o_(t,g) = Σ_{t' ≤ t, g'} γ^(t-t') (q_(t,g)·k_(t',g')) v_(t',g') + γ^t q_(t,g) state.

    With ``closed_form`` the in-chunk scores q·k come from ``closed_form.fn(q' k'ᵀ)`` on the (smaller)
    ``closed_form.q`` / ``.k`` instead of the features (Taylor: 1 + t + t²/2 from D-dim dot products).

    ``reverse`` runs the same recurrence backwards in time (anti-causal): o_(t,g) sums t' ≥ t with
    γ^(t'-t), plus γ^(N-1-t) q state; equal to flipping the positions of every input, scanning and
    flipping back, without the copies. Chunks are then aligned to the end of the sequence.
    """
    n = k.shape[1] // gk
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    chunk = min(chunk_size, n)
    tables = ChunkTables(log_decay, chunk, gq, gk, q.dtype, q.device, reverse) if n else None
    if reverse:
        starts = [(max(0, end - chunk), min(chunk, end)) for end in range(n, 0, -chunk)]
    else:
        starts = [(start, min(chunk, n - start)) for start in range(0, n, chunk)]
    for start, length in starts:
        if length != tables.length:
            tables = ChunkTables(log_decay, length, gq, gk, q.dtype, q.device, reverse)
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
        tables.head_view(scores).mul_(tables.intra)
        oc = torch.bmm(qc, state)
        if tables.q_decay is not None:
            tables.head_view(oc).mul_(tables.q_decay)  # (γ^t q) S = γ^t (q S)
            tables.head_view(state).mul_(tables.carry)
            kc = (tables.head_view(kc) * tables.k_decay).view_as(kc)
        oc.baddbmm_(scores, vc)
        out[:, start * gq:(start + length) * gq] = oc
        state.baddbmm_(kc.transpose(1, 2), vc)
    return out


class CausalScan(torch.autograd.Function):
    """:func:`scan` with a recomputing backward. With o = scan(q, k, v; S₀) and S_N its final state:

    * dq = scan(do, v, k; S₀ᵀ)  (causal);
    * dk = scan(v, do, q; γ dS_Nᵀ) and dv = scan(k, q, do; γ dS_N), both run in reverse (anti-causal: the
      same weights γ^(t'-t), read backwards);
    * dS₀ = Σ_t γ^t q_tᵀ do_t + γ^N dS_N.
    """

    @staticmethod
    def forward(ctx, q, k, v, state0, gq, log_decay, chunk_size):
        state = state0.clone()
        out = scan(q, k, v, state, gq=gq, gk=1, log_decay=log_decay, chunk_size=chunk_size)
        ctx.save_for_backward(q, k, v, state0)
        ctx.gq, ctx.log_decay, ctx.chunk_size = gq, log_decay, chunk_size
        return out, state

    @staticmethod
    def backward(ctx, d_out, d_state):
        with torch.autocast(d_out.device.type, enabled=False):  # a backward run inside an autocast region
            return CausalScan._backward(ctx, d_out, d_state)

    @staticmethod
    def _backward(ctx, d_out, d_state):
        q, k, v, state0 = ctx.saved_tensors
        gq, log_decay, chunk = ctx.gq, ctx.log_decay, ctx.chunk_size
        kw = {"log_decay": log_decay, "chunk_size": chunk}
        n = k.shape[1]
        gamma = None if log_decay is None else torch.exp(log_decay.to(q.dtype)).repeat(q.shape[0] // log_decay.numel())
        d_state_in = d_state if gamma is None else d_state * gamma.view(-1, 1, 1)  # γ dS_N
        dq = dk = dv = ds0 = None
        if ctx.needs_input_grad[0]:
            dq = scan(d_out, v, k, state0.transpose(1, 2).clone(memory_format=torch.contiguous_format), gq=gq,
                      gk=1, **kw)
        if ctx.needs_input_grad[1]:
            dk = scan(v, d_out, q, d_state_in.transpose(1, 2).clone(memory_format=torch.contiguous_format),
                      gq=1, gk=gq, reverse=True, **kw)
        if ctx.needs_input_grad[2]:
            dv = scan(k, q, d_out, d_state_in.clone(memory_format=torch.contiguous_format), gq=1, gk=gq,
                      reverse=True, **kw)
        if ctx.needs_input_grad[3]:
            qw = q
            if gamma is not None:
                pos = torch.arange(n, device=q.device, dtype=q.dtype).repeat_interleave(gq)
                qw = q * torch.exp(torch.log(gamma).view(-1, 1, 1) * pos.view(1, -1, 1))
            carry = 1.0 if gamma is None else gamma.pow(n).view(-1, 1, 1)
            ds0 = qw.transpose(1, 2) @ d_out + carry * d_state
        return dq, dk, dv, ds0, None, None, None


def causal_chunked(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    state: LinearState | None = None,
    log_decay: torch.Tensor | None = None,
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
    decay = None if log_decay is None else log_decay.to(fq.dtype)
    out, s_aug = CausalScan.apply(query_rows(fq), fk.reshape(b * h, n, f), v3, state.augmented(), g, decay,
                                  chunk_size)
    out = out.view(b, h, n, g, dv + 1).transpose(2, 3)
    return out[..., :dv], out[..., dv], LinearState.from_augmented(s_aug, b)
