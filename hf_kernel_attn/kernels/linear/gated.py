"""Gated linear attention: a data-dependent decay per token (Yang et al., ICML 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training"), normalised as the other feature maps:

    S_t = diag(α_t) S_{t-1} + φ(k_t) [v_t, 1]ᵀ,      out_t = φ(q_t)ᵀ S_t[:, :Dv] / max(φ(q_t)ᵀ S_t[:, Dv], eps)

so key j reaches query i ≥ j with weight w_ij = exp(b_i - b_j) per feature, b_t = Σ_{s ≤ t} log α_s ≤ 0 (α per
key feature, one per head, or Γ gates tiled over the F features: feature f decays by gate f mod Γ).
Bidirectionally, j > i weighs exp(b_j - b_i), the same recurrence run backwards. With a window W (the LoLCATs /
Liger hybrid), the W most recent keys are exact softmax and only keys j ≤ i - W enter through the gated state,
all under one normaliser (as in :mod:`.window`):

    out_i = (Σ_{j∈win(i)} e^{s q_i·k_j} [v_j, 1] + λ Σ_{j ≤ i-W} Σ_f φ_f(q_i) w_ij,f φ_f(k_j) [v_j, 1])_{:Dv} / (…)_{Dv}

Evaluation (:class:`GatedScan`, with a hand-written backward): chunks of C positions; inside a chunk the pairwise
weights come from q̃ = φ(q) ⊙ e^{b_t - b_r} and k̃ = φ(k) ⊙ e^{b_r - b_j} (b_r the log-decay at the chunk's middle),
across chunks a state of F × (Dv + 1) per KV head; with a window, the state's keys are the keys W positions
back, k'_t = φ(k_{t-W}) ⊙ e^{b_t - b_{t-W}}, so one causal pass yields the part beyond the window. log α is
clamped at ``MIN_LOG_GATE`` so that e^{±(b_t - b_r)} stays finite in fp32 within a chunk (C/2 · 1.25 ≤ 40; GLA's
log σ(·)/16 gates reach the bound only for logits below -20).

The state of a call (:class:`.state.LinearState`: S ``[B, Hkv, F, Dv]``, z ``[B, Hkv, F]``) holds the keys
before the ones a next call passes again (a window hybrid's last W - 1), decayed to the last of them.
"""

from __future__ import annotations

import torch

from ..base import accum
from .spec import CAUSAL_CALL, HybridCall, HybridInputs, HybridSpec
from .state import LinearState, with_ones

MIN_LOG_GATE = -1.25
GATED_CHUNK = 64
MAX_CHUNK_LOG_RANGE = 80.0  # C · |MIN_LOG_GATE|: factors up to e^{C/2 · 1.25} = e^{40} stay finite in fp32


def grouped(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x ⊙ factor with ``factor`` ``[..., Γ]`` tiled over the features ``[..., F]``: gate i covers every feature
    f ≡ i (mod Γ) (Γ = F: one per feature, Γ = 1: one per head)."""
    gates = factor.shape[-1]
    if gates == x.shape[-1] or gates == 1:
        return x * factor
    return x * torch.cat([factor] * (x.shape[-1] // gates), -1)  # faster on CPU than a broadcast over [F/Γ, Γ]


def per_feature(factor: torch.Tensor, features: int) -> torch.Tensor:
    """``[..., Γ]`` -> ``[..., F]``: the gates tiled over the features (feature f reads gate f mod Γ)."""
    gates = factor.shape[-1]
    return factor if gates == features else factor.repeat(*([1] * (factor.dim() - 1)), features // gates)


def _group_sum(x: torch.Tensor, gates: int) -> torch.Tensor:
    """``[..., F]`` -> ``[..., Γ]``: for each gate, the sum over the features it covers."""
    return x.unflatten(-1, (-1, gates)).sum(-2)


def cumulative(log_gate: torch.Tensor) -> torch.Tensor:
    """b_t = Σ_{s ≤ t} log α_s along the positions (dim -2)."""
    return log_gate.cumsum(-2)


def shifted_keys(fk: torch.Tensor, v: torch.Tensor, log_gate: torch.Tensor, window: int):
    """Keys W positions back as seen from t: k'_t = φ(k_{t-W}) ⊙ exp(b_t - b_{t-W}) and v'_t = v_{t-W} (zero for
    t < W), so that a causal pass with the same gates sums exactly the keys j ≤ i - W."""
    n = fk.shape[-2]
    b = cumulative(log_gate)
    if window >= n:
        return torch.zeros_like(fk), torch.zeros_like(v)
    decay = (b[..., window:, :] - b[..., :n - window, :]).exp()
    pad_k = fk.new_zeros(*fk.shape[:-2], window, fk.shape[-1])
    pad_v = v.new_zeros(*v.shape[:-2], window, v.shape[-1])
    shifted_k = torch.cat([pad_k, grouped(fk[..., :n - window, :], decay)], -2)
    return shifted_k, torch.cat([pad_v, v[..., :n - window, :]], -2)


def _chunks(fq, fk, v1, log_gate, c: int):
    """Pad N to a multiple of ``c`` (zero keys, values, queries and log-gates after the end change nothing before
    it) and view every input by chunk: ``[B, H, G, nc, C, F]``, ``[B, H, nc, C, ·]``."""
    b_, h, g, n, f = fq.shape
    nc = -(-n // c)
    pad = nc * c - n
    if pad:
        fq, fk, v1, log_gate = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v1, log_gate))
    return (fq.reshape(b_, h, g, nc, c, f), fk.reshape(b_, h, nc, c, f), v1.reshape(b_, h, nc, c, -1),
            log_gate.reshape(b_, h, nc, c, -1))


def scale_rows(state: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """A state ``[..., F, E]`` with row f scaled by its gate's factor ``[..., Γ]`` (gate f mod Γ)."""
    gates = factor.shape[-1]
    if gates == 1 or gates == state.shape[-2]:
        return state * factor.unsqueeze(-1)
    return (state.unflatten(-2, (-1, gates)) * factor[..., None, :, None]).flatten(-3, -2)


def within_chunks(gate: torch.Tensor) -> torch.Tensor:
    """b_t - b_(chunk start - 1) = Σ_{s ≤ t in the chunk} log α_s for ``gate`` ``[..., C, Γ]``: one matmul with the
    lower-triangular ones (on CPU about twice as fast as ``cumsum`` along a middle dimension)."""
    c = gate.shape[-2]
    return torch.ones(c, c, dtype=gate.dtype, device=gate.device).tril_() @ gate


def _reference(rel: torch.Tensor) -> torch.Tensor:
    """b at each chunk's reference position r = C/2 - 1 (``rel`` ``[..., C, Γ]`` -> ``[..., Γ]``)."""
    return rel[..., max(0, rel.shape[-2] // 2 - 1), :]


class _ChunkFactors:
    """The gate factors of every chunk, relative to a reference position r = C/2 - 1 inside it (b_t from the
    chunk's start, ``[B, H, nc, C, Γ]``): q̃ = φ(q) e^{b_t - b_r} and k̃ = φ(k) e^{b_r - b_j}, both ≤ e^{(C/2)|log α|max}
    ≤ e^{40} in fp32, whose product is e^{b_t - b_j} ≤ 1 for every visible pair j ≤ t. Rows of a state are scaled
    by ``start_to_ref`` = e^{b_r} (the state entering the chunk, as q̃ reads it), ``ref_to_end`` = e^{b_end - b_r}
    (k̃ as the chunk's end sees it) and ``carry`` = e^{b_end} (``[B, H, nc, Γ]``)."""

    def __init__(self, q, k, g):
        rel = within_chunks(g)
        ref = _reference(rel)
        end = rel[..., -1, :]
        self.up = (rel - ref.unsqueeze(-2)).exp()
        self.down = (ref.unsqueeze(-2) - rel).exp()
        self.q = grouped(q, self.up.unsqueeze(2))
        self.k = grouped(k, self.down)
        self.start_to_ref = ref.exp()
        self.ref_to_end = (end - ref).exp()
        self.carry = end.exp()


def _entering_states(factors: _ChunkFactors, v, s0):
    """The state entering each chunk ``[B, H, nc, F, E]`` and the state after the last: S_{i+1} = e^{b_end,i} ⊙ S_i
    + e^{b_end - b_r} ⊙ k̃ᵀ v1, per row. One batched matmul for the chunks' own sums, then one pass over the
    chunks (one fused multiply-add each, written in place)."""
    updates = scale_rows(factors.k.transpose(-1, -2) @ v, factors.ref_to_end)  # [B, H, nc, F, E]
    return _running(updates, per_feature(factors.carry, updates.shape[-2]).unsqueeze(-1), s0, reverse=False)


def _running(updates: torch.Tensor, carry: torch.Tensor, s0: torch.Tensor, reverse: bool):
    """x_0 = s0, x_{i+1} = carry_i ⊙ x_i + updates_i over the chunks (dim 2; from the last chunk when ``reverse``):
    every x_i before its update ``[B, H, nc, F, E]``, and the last x."""
    nc = updates.shape[2]
    out = torch.empty(*updates.shape[:2], nc + 1, *updates.shape[3:], dtype=updates.dtype, device=updates.device)
    order = range(nc - 1, -1, -1) if reverse else range(nc)
    first = nc if reverse else 0
    out[:, :, first] = s0
    for i in order:
        src, dst = (i + 1, i) if reverse else (i, i + 1)
        torch.addcmul(updates[:, :, i], out[:, :, src], carry[:, :, i], out=out[:, :, dst])
    return (out[:, :, 1:], out[:, :, 0]) if reverse else (out[:, :, :nc], out[:, :, nc])


def _visible_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a bᵀ with the pairs j > t set to zero (where the factors' product may be large: tril_, not a multiply)."""
    return (a @ b.transpose(-1, -2)).tril_()


class GatedScan(torch.autograd.Function):
    """The chunked causal gated scan with a recomputing backward (nothing N-sized saved beyond the inputs).

    Forward, per chunk (factors of :class:`_ChunkFactors`, A = tril(q̃ k̃ᵀ)): o = A v1 + q̃ (e^{b_r} ⊙ S_in).
    Backward, per chunk, with dS_out the gradient of the state after the chunk (one reverse pass:
    dS_in = e^{b_end} ⊙ dS_out + e^{b_r} ⊙ q̃ᵀ do) and dA = tril(do v1ᵀ), D = e^{b_end - b_r} ⊙ dS_out:

        dq = (dA k̃ + do (e^{b_r} ⊙ S_in)ᵀ) ⊙ e^{b_t - b_r},   dk = (dAᵀ q̃ + v1 Dᵀ) ⊙ e^{b_r - b_t},   dv1 = Aᵀ do + k̃ D,

    and the gates from the identity of gated linear attention (Yang et al. 2024, §4): q and k enter only as
    φ(q_t) e^{b_t} and φ(k_t) e^{-b_t}, so ∂L/∂b_t = φ(q_t) ⊙ dq_t - φ(k_t) ⊙ dk_t (+ S_N ⊙ dS_N summed over the
    values at the last position, through the returned state), summed over each gate's features, and
    ∂L/∂log α_s = Σ_{t ≥ s} ∂L/∂b_t.
    """

    @staticmethod
    def forward(ctx, fq, fk, v1, log_gate, s0, chunk_size):
        b_, h, g, n, f = fq.shape
        c = min(chunk_size, n)
        q, k, v, gate = _chunks(fq, fk, v1, log_gate, c)
        rel = within_chunks(gate)
        ref = _reference(rel).clone()
        to_ref = per_feature(ref.exp(), f).unsqueeze(-1)  # [B, H, nc, F, 1]
        to_end = per_feature((rel[..., -1, :] - ref).exp(), f).unsqueeze(-1)
        rel.sub_(ref.unsqueeze(-2))
        up = rel.exp()  # [B, H, nc, C, Γ]
        down = rel.neg_().exp_()  # in place: fresh N-sized buffers cost on CPU
        up = up.unsqueeze(2)
        out = q.new_empty(b_, h, g, q.shape[3], c, v.shape[-1])
        s = s0
        # one chunk at a time, everything in cache (module docstring); unbind: every chunk's views in one call
        for qi, ki, vi, upi, downi, to_ref_i, to_end_i, oi in zip(
                q.unbind(3), k.unbind(2), v.unbind(2), up.unbind(3), down.unbind(2), to_ref.unbind(2),
                to_end.unbind(2), out.unbind(3), strict=True):
            qi = grouped(qi, upi)
            ki = grouped(ki, downi)
            w = s * to_ref_i  # e^{b_r} ⊙ S
            torch.matmul(qi, w.unsqueeze(2), out=oi)
            oi.add_(_visible_scores(qi, ki.unsqueeze(2)) @ vi.unsqueeze(2))
            s = w.add_(ki.transpose(-1, -2) @ vi).mul_(to_end_i)
        ctx.save_for_backward(fq, fk, v1, log_gate, s0, s)
        ctx.chunk = c
        return out.reshape(b_, h, g, -1, v1.shape[-1])[..., :n, :], s

    @staticmethod
    def backward(ctx, d_out, d_final):
        with torch.autocast(d_out.device.type, enabled=False):  # a backward run inside an autocast region
            return GatedScan._backward(ctx, d_out, d_final)

    @staticmethod
    def _backward(ctx, d_out, d_final):
        fq, fk, v1, log_gate, s0, final = ctx.saved_tensors
        c = ctx.chunk
        b_, h, g, n, f = fq.shape
        e, gates = v1.shape[-1], log_gate.shape[-1]
        if d_out is None:
            d_out = fq.new_zeros(b_, h, g, n, e)
        if d_final is None:
            d_final = torch.zeros_like(final)
        q, k, v, gate = _chunks(fq, fk, v1, log_gate, c)
        nc = q.shape[3]
        do = torch.nn.functional.pad(d_out, (0, 0, 0, nc * c - n)).reshape(b_, h, g, nc, c, e)
        factors = _ChunkFactors(q, k, gate)
        states, _ = _entering_states(factors, v, s0)
        from_out = scale_rows((factors.q.transpose(-1, -2) @ do).sum(2), factors.start_to_ref)  # [B, H, nc, F, E]
        d_after, ds = _running(from_out, per_feature(factors.carry, f).unsqueeze(-1), d_final, reverse=True)
        d_end = scale_rows(d_after, factors.ref_to_end)
        k_t, v_t = factors.k.unsqueeze(2), v.unsqueeze(2)
        d_scores = _visible_scores(do, v_t)  # [B, H, G, nc, C, C]
        dq = (d_scores @ k_t).add_(do @ scale_rows(states, factors.start_to_ref).unsqueeze(2).transpose(-1, -2))
        dq = grouped(dq, factors.up.unsqueeze(2))
        dk = grouped((d_scores.transpose(-1, -2) @ factors.q).sum(2).add_(v @ d_end.transpose(-1, -2)), factors.down)
        scores = _visible_scores(factors.q, k_t)
        dv = (scores.transpose(-1, -2) @ do).sum(2).add_(factors.k @ d_end)
        d_gate = None
        if ctx.needs_input_grad[3]:  # a fixed decay (constant gates) needs none
            d_b = _group_sum((q * dq).sum(2) - k * dk, gates).reshape(b_, h, -1, gates)
            d_b[:, :, -1] += _group_sum((final * d_final).sum(-1), gates)  # b_N scales the returned state
            d_gate = d_b.flip(-2).cumsum(-2).flip(-2)[:, :, :n]
        return (dq.reshape(b_, h, g, -1, f)[..., :n, :], dk.reshape(b_, h, -1, f)[:, :, :n],
                dv.reshape(b_, h, -1, e)[:, :, :n], d_gate, ds, None)


def gated_causal(fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, log_gate: torch.Tensor,
                 state: torch.Tensor | None, chunk_size: int = GATED_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """o_i = Σ_{j ≤ i} (φ(q_i) ⊙ e^{b_i - b_j}) · φ(k_j) v1_j + (φ(q_i) ⊙ e^{b_i}) · S₀, and the state after the
    last key, S_N = e^{b_N} ⊙ S₀ + Σ_j e^{b_N - b_j} φ(k_j) v1_jᵀ.

    ``fq`` ``[B, H, G, N, F]``, ``fk`` ``[B, H, N, F]``, ``v1`` ``[B, H, N, E]`` (values with their ones column),
    ``log_gate`` ``[B, H, N, F]`` or ``[B, H, N, 1]``, ``state`` ``[B, H, F, E]`` or None; returns o
    ``[B, H, G, N, E]`` and S_N. Chunks of ``chunk_size``: every chunk's own part in one batched matmul, the
    chunk states in one pass over the chunks; differentiable in every input through :class:`GatedScan`."""
    b_, h, g, n, f = fq.shape
    e = v1.shape[-1]
    s0 = fq.new_zeros(b_, h, f, e) if state is None else state
    if n == 0:
        return fq.new_zeros(b_, h, g, 0, e), s0
    return GatedScan.apply(fq, fk, v1, log_gate, s0, chunk_size)


def fold(fk: torch.Tensor, v1: torch.Tensor, log_gate: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """The state after folding keys ``fk`` (with their gates) into ``state``: e^{b_L} ⊙ S + Σ_j e^{b_L - b_j} φ(k_j)
    v1_jᵀ (``[B, H, F, E]``)."""
    if fk.shape[-2] == 0:  # no keys: the state as it is
        return fk.new_zeros(*fk.shape[:2], fk.shape[-1], v1.shape[-1]) if state is None else state
    b = cumulative(log_gate)
    last = b[:, :, -1:]
    folded = grouped(fk, (last - b).exp()).transpose(-1, -2) @ v1
    if state is None:
        return folded
    return grouped(state.transpose(-1, -2), last.exp()).transpose(-1, -2) + folded


def reverse_gates(log_gate: torch.Tensor) -> torch.Tensor:
    """Gates of the time-reversed sequence, so that a causal pass over it weighs j > i by Π_{s=i+1..j} α_s:
    g'_t = g_{N-t} (t ≥ 1), g'_0 = 0."""
    flipped = log_gate.flip(-2)
    return torch.cat([torch.zeros_like(flipped[:, :, :1]), flipped[:, :, :-1]], -2)


def gated_linear(fq, fk, v, log_gate, *, causal: bool, key_mask=None, state: LinearState | None = None,
                 chunk_size: int = GATED_CHUNK):
    """Gated linear attention without a window: numerator ``[B, H, G, N, Dv]`` and denominator ``[B, H, G, N]`` for
    the last N of M keys, and (causal) the state after every key."""
    fq, fk, v, log_gate = accum(fq), accum(fk), accum(v), accum(log_gate)
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)
    v1 = with_ones(v)
    m, n = fk.shape[-2], fq.shape[-2]
    dv = v.shape[-1]
    if causal:
        start = augmented_state(state)
        prefix = m - n
        if prefix:  # keys before the queries: folded into the starting state
            start = fold(fk[:, :, :prefix], v1[:, :, :prefix], log_gate[:, :, :prefix], start)
        out, final = gated_causal(fq, fk[:, :, prefix:], v1[:, :, prefix:], log_gate[:, :, prefix:], start,
                                  chunk_size)
        new_state = LinearState(final[..., :dv], final[..., dv])
        return out[..., :dv], out[..., dv], new_state
    fq = queries_at_key_positions(fq, m)
    fwd, _ = gated_causal(fq, fk, v1, log_gate, None, chunk_size)
    bwd, _ = gated_causal(fq.flip(-2), fk.flip(-2), v1.flip(-2), reverse_gates(log_gate), None, chunk_size)
    diag = (fq * fk.unsqueeze(2)).sum(-1, keepdim=True) * v1.unsqueeze(2)  # j = i, counted by both passes
    out = (fwd + bwd.flip(-2) - diag)[..., m - n:, :]
    return out[..., :dv], out[..., dv], None


def queries_at_key_positions(fq: torch.Tensor, m: int) -> torch.Tensor:
    """Bidirectionally, N < M queries sit at the last N key positions: zero rows in front align them with the
    keys (their outputs are dropped)."""
    n = fq.shape[-2]
    return fq if n == m else torch.cat([fq.new_zeros(*fq.shape[:-2], m - n, fq.shape[-1]), fq], -2)


def softmax_band(qf, kf, v1, real, spec: HybridSpec, call: HybridCall = CAUSAL_CALL, block: int = 64):
    """The softmax part of the hybrid, a block of queries at a time against the keys their windows can reach (and the
    sinks outside their windows): Σ_{j∈win(i) ∪ sinks} e^{s q_i·k_j - c_i} [v_j, 1] ``[B, H, G, N, E]`` and
    c_i = max(0, max_j s q_i·k_j) ``[..., 1]``. Key j of ``kf`` sits at position offset + j; a sink inside a query's
    window is one of the band's keys. ``spec``: W and the scale; ``call``: ``causal``, ``sinks``, ``offset``."""
    window, scaling = spec.window, spec.scaling
    causal, sinks, offset = call.causal, call.sinks, call.offset
    n, m = qf.shape[-2], kf.shape[-2]
    exact, shifts = [], []
    if sinks is not None:
        sink_k = accum(sinks.keys).transpose(-1, -2).unsqueeze(2)  # [B, H, 1, D, S]
        sink_v = with_ones(accum(sinks.values)).unsqueeze(2)  # [B, H, 1, S, E]
        sink_pos = sinks.pos - offset  # [B, S], relative to kf's first key
    for start in range(0, n, block):
        end = min(start + block, n)
        p0, p1 = m - n + start, m - n + end  # the block's query positions
        lo = max(0, p0 - window + 1)
        hi = p1 if causal else min(m, p1 + window - 1)
        qpos = torch.arange(p0, p1, device=qf.device)
        kpos = torch.arange(lo, hi, device=qf.device)
        dist = qpos[:, None] - kpos[None, :]
        near = (dist >= 0) & (dist < window) if causal else dist.abs() < window
        visible = near[None, None, None] & real[:, None, None, None, lo:hi]
        logits = scaling * qf[:, :, :, start:end] @ kf[:, :, None, lo:hi].transpose(-1, -2)
        logits = logits.masked_fill(~visible, float("-inf"))
        shift = logits.amax(-1, keepdim=True)
        if sinks is not None:
            ds = qpos[None, :, None] - sink_pos[:, None, :]  # [B, nb, S]
            seen = ((ds >= window) if causal else (ds.abs() >= window)) & sinks.valid[:, None, :]
            sink_logits = (scaling * qf[:, :, :, start:end] @ sink_k).masked_fill(~seen[:, None, None], float("-inf"))
            shift = torch.maximum(shift, sink_logits.amax(-1, keepdim=True))
        shift = shift.clamp_min(0.0)
        part = (logits - shift).exp() @ v1[:, :, None, lo:hi]
        if sinks is not None:
            part = part + (sink_logits - shift).exp() @ sink_v
        exact.append(part)
        shifts.append(shift)
    return torch.cat(exact, -2), torch.cat(shifts, -2)


def augmented_state(state: LinearState | None) -> torch.Tensor | None:
    """[S, z] ``[B, H, F, Dv + 1]``."""
    return None if state is None else torch.cat([state.S, state.z.unsqueeze(-1)], -1)


def gated_hybrid(x: HybridInputs, log_gate: torch.Tensor, spec: HybridSpec, call: HybridCall = CAUSAL_CALL):
    """The window hybrid with a gated state (module docstring): ``q`` ``[B, H, G, N, D]`` (grouped), ``k``/``v``
    ``[B, H, M, ·]``; returns the normalised output ``[B, H, G, N, Dv]`` and (causal) the state holding every
    key but the last W - 1, decayed to the last key it holds. ``sinks`` (StreamingLLM; k's first key at position
    ``offset``): softmax keys for every query that can see them, left out of the gated part and the state. ``x``:
    the inputs; ``spec``: W, the scale, the chunk size; ``call``: the mask, state, ln λ, sinks and offset."""
    q, k, v, fq, fk = x.q, x.k, x.v, x.fq, x.fk
    window, chunk_size = spec.window, spec.chunk_size
    causal, key_mask, state, log_mix, sinks, offset = (call.causal, call.key_mask, call.state, call.log_mix,
                                                       call.sinks, call.offset)
    fq, fk, log_gate = accum(fq), accum(fk), accum(log_gate)
    qf, kf, vf = accum(q), accum(k), accum(v)
    b_, h, g, n, _ = qf.shape
    m, dv = kf.shape[-2], vf.shape[-1]
    real = torch.ones(b_, m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.to(torch.bool)
    linear_keys = real
    if sinks is not None:
        linear_keys = real & ~sinks.holds(offset, m)
    fkm = fk * linear_keys[:, None, :, None].to(fk.dtype)
    v1 = with_ones(vf)
    exact, shift = softmax_band(qf, kf, v1, real, spec, call)
    # the gated part: keys j <= i - W (and j >= i + W bidirectionally) through the shifted keys
    s0 = augmented_state(state)
    sk, sv = shifted_keys(fkm, v1, log_gate, window)
    prefix = m - n
    if causal:
        start = s0
        if prefix:
            start = fold(sk[:, :, :prefix], sv[:, :, :prefix], log_gate[:, :, :prefix], s0)
        far, _ = gated_causal(fq, sk[:, :, prefix:], sv[:, :, prefix:], log_gate[:, :, prefix:], start, chunk_size)
    else:
        fqm = queries_at_key_positions(fq, m)
        far, _ = gated_causal(fqm, sk, sv, log_gate, None, chunk_size)
        rg = reverse_gates(log_gate)
        rk, rv = shifted_keys(fkm.flip(-2), v1.flip(-2), rg, window)
        back, _ = gated_causal(fqm.flip(-2), rk, rv, rg, None, chunk_size)
        far = (far + back.flip(-2))[..., m - n:, :]
    if log_mix is not None:
        far = far * log_mix.exp()[None, :, :, None, None]
    total = exact + far * (-shift).exp()
    out = total[..., :dv] / total[..., dv:].clamp_min(1e-30)
    if not causal:
        return out, None
    keep = min(m, window - 1)
    folded = fold(fkm[:, :, :m - keep], v1[:, :, :m - keep], log_gate[:, :, :m - keep], s0)
    return out, LinearState(folded[..., :dv], folded[..., dv])
