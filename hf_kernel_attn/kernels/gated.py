"""Gated linear attention: a data-dependent decay per token (Yang et al., ICML 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training"), normalised as the other feature maps:

    S_t = diag(α_t) S_{t-1} + φ(k_t) [v_t, 1]ᵀ,      out_t = φ(q_t)ᵀ S_t[:, :Dv] / max(φ(q_t)ᵀ S_t[:, Dv], eps)

so key j reaches query i ≥ j with weight w_ij = exp(b_i - b_j) per feature, b_t = Σ_{s ≤ t} log α_s ≤ 0 (α per
key feature, or one per head broadcast over the features). Bidirectionally, j > i weighs exp(b_j - b_i), the
same recurrence run backwards. With a window W (the LoLCATs / Liger hybrid), the W most recent keys are exact
softmax and only keys j ≤ i - W enter through the gated state, all under one normaliser (kernels/window.py):

    out_i = (Σ_{j∈win(i)} e^{s q_i·k_j} [v_j, 1] + λ Σ_{j ≤ i-W} Σ_f φ_f(q_i) w_ij,f φ_f(k_j) [v_j, 1])_{:Dv} / (…)_{Dv}

Evaluation: chunks of C positions; inside a chunk the pairwise weights come from q̃ = φ(q) ⊙ e^{b_t - b₀} and
k̃ = φ(k) ⊙ e^{b₀ - b_j} (b₀ the log-decay at the chunk's start), across chunks a state of F × (Dv + 1) per KV
head; with a window, the state's keys are the keys W positions back, k'_t = φ(k_{t-W}) ⊙ e^{b_t - b_{t-W}}, so
one causal pass yields the part beyond the window. log α is clamped at ``MIN_LOG_GATE`` so that e^{b₀ - b_j}
stays finite in fp32 within a chunk, in the forward and in the backward's products (C · 1.25 ≤ 40; GLA's
log σ(·)/16 gates reach the bound only for logits below -20).

The state of a call (:class:`.linear.LinearState`: S ``[B, Hkv, F, Dv]``, z ``[B, Hkv, F]``) holds the keys
before the ones a next call passes again (a window hybrid's last W - 1), decayed to the last of them.
"""

from __future__ import annotations

import torch

from .base import accum
from .linear import LinearState, with_ones

MIN_LOG_GATE = -1.25
GATED_CHUNK = 32
MAX_CHUNK_LOG_RANGE = 40.0  # C · |MIN_LOG_GATE|: e^{40} factors, and their products in the backward, stay finite


def cumulative(log_gate: torch.Tensor) -> torch.Tensor:
    """b_t = Σ_{s ≤ t} log α_s along the positions (dim -2)."""
    return log_gate.cumsum(-2)


def _shifted(fk: torch.Tensor, v: torch.Tensor, log_gate: torch.Tensor, window: int):
    """Keys W positions back as seen from t: k'_t = φ(k_{t-W}) ⊙ exp(b_t - b_{t-W}) and v'_t = v_{t-W} (zero for
    t < W), so that a causal pass with the same gates sums exactly the keys j ≤ i - W."""
    n = fk.shape[-2]
    b = cumulative(log_gate)
    if window >= n:
        return torch.zeros_like(fk), torch.zeros_like(v)
    decay = (b[..., window:, :] - b[..., :n - window, :]).exp()
    pad_k = fk.new_zeros(*fk.shape[:-2], window, fk.shape[-1])
    pad_v = v.new_zeros(*v.shape[:-2], window, v.shape[-1])
    return torch.cat([pad_k, fk[..., :n - window, :] * decay], -2), torch.cat([pad_v, v[..., :n - window, :]], -2)


def gated_causal(fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, log_gate: torch.Tensor,
                 state: torch.Tensor | None, chunk_size: int = GATED_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """o_i = Σ_{j ≤ i} (φ(q_i) ⊙ e^{b_i - b_j}) · φ(k_j) v1_j + (φ(q_i) ⊙ e^{b_i}) · S₀, and the state after the
    last key, S_N = e^{b_N} ⊙ S₀ + Σ_j e^{b_N - b_j} φ(k_j) v1_jᵀ.

    ``fq`` ``[B, H, G, N, F]``, ``fk`` ``[B, H, N, F]``, ``v1`` ``[B, H, N, E]`` (values with their ones column),
    ``log_gate`` ``[B, H, N, F]`` or ``[B, H, N, 1]``, ``state`` ``[B, H, F, E]`` or None; returns o
    ``[B, H, G, N, E]`` and S_N. Every chunk's in-chunk part in one batched matmul, then the chunk states in one
    pass over the chunks; differentiable in every input (autograd)."""
    b_, h, g, n, f = fq.shape
    e = v1.shape[-1]
    s0 = fq.new_zeros(b_, h, f, e) if state is None else state
    if n == 0:
        return fq.new_zeros(b_, h, g, 0, e), s0
    c = min(chunk_size, n)
    nc = -(-n // c)
    pad = nc * c - n
    if pad:  # zero keys, values and gates (log α = 0) after the end change nothing before it
        fq = torch.nn.functional.pad(fq, (0, 0, 0, pad))
        fk = torch.nn.functional.pad(fk, (0, 0, 0, pad))
        v1 = torch.nn.functional.pad(v1, (0, 0, 0, pad))
        log_gate = torch.nn.functional.pad(log_gate, (0, 0, 0, pad))
    gf = log_gate.shape[-1]
    bc = log_gate.reshape(b_, h, nc, c, gf).cumsum(-2)  # b relative to each chunk's start
    grow = bc.exp()  # e^{b_t} <= 1
    qc = fq.reshape(b_, h, g, nc, c, f) * grow.unsqueeze(2)  # φ(q_t) e^{b_t}
    kc = fk.reshape(b_, h, nc, c, f) * (-bc).exp()  # φ(k_j) e^{-b_j} <= e^{40} (not 1 / grow: its backward overflows)
    vc = v1.reshape(b_, h, nc, c, e)
    tril = torch.ones(c, c, dtype=fq.dtype, device=fq.device).tril()
    scores = (qc @ kc.unsqueeze(2).transpose(-1, -2)) * tril  # [B, H, G, nc, C, C]
    out = scores @ vc.unsqueeze(2)
    carries = grow[:, :, :, -1:].transpose(-1, -2)  # [B, H, nc, F or 1, 1]: e^{b} over each whole chunk
    updates = (kc.transpose(-1, -2) @ vc) * carries  # Σ_j e^{b_end - b_j} φ(k_j) v1_jᵀ  [B, H, nc, F, E]
    before = []  # the state entering each chunk
    s = s0
    for i in range(nc):
        before.append(s)
        s = s * carries[:, :, i] + updates[:, :, i]
    out = out + qc @ torch.stack(before, 2).unsqueeze(2)
    return out.reshape(b_, h, g, nc * c, e)[..., :n, :], s


def fold(fk: torch.Tensor, v1: torch.Tensor, log_gate: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """The state after folding keys ``fk`` (with their gates) into ``state``: e^{b_L} ⊙ S + Σ_j e^{b_L - b_j} φ(k_j)
    v1_jᵀ (``[B, H, F, E]``)."""
    b = cumulative(log_gate)
    last = b[:, :, -1:] if b.shape[-2] else torch.zeros_like(log_gate[:, :, :1])
    folded = (fk * (last - b).exp()).transpose(-1, -2) @ v1
    if state is None:
        return folded
    return state * last.transpose(-1, -2).exp() + folded


def _reverse_gates(log_gate: torch.Tensor) -> torch.Tensor:
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
        start = _augmented(state)
        prefix = m - n
        if prefix:  # keys before the queries: folded into the starting state
            start = fold(fk[:, :, :prefix], v1[:, :, :prefix], log_gate[:, :, :prefix], start)
        out, final = gated_causal(fq, fk[:, :, prefix:], v1[:, :, prefix:], log_gate[:, :, prefix:], start,
                                  chunk_size)
        new_state = LinearState(final[..., :dv], final[..., dv])
        return out[..., :dv], out[..., dv], new_state
    fq = _queries_at_key_positions(fq, m)
    fwd, _ = gated_causal(fq, fk, v1, log_gate, None, chunk_size)
    bwd, _ = gated_causal(fq.flip(-2), fk.flip(-2), v1.flip(-2), _reverse_gates(log_gate), None, chunk_size)
    diag = (fq * fk.unsqueeze(2)).sum(-1, keepdim=True) * v1.unsqueeze(2)  # j = i, counted by both passes
    out = (fwd + bwd.flip(-2) - diag)[..., m - n:, :]
    return out[..., :dv], out[..., dv], None


def _queries_at_key_positions(fq: torch.Tensor, m: int) -> torch.Tensor:
    """Bidirectionally, N < M queries sit at the last N key positions: zero rows in front align them with the
    keys (their outputs are dropped)."""
    n = fq.shape[-2]
    return fq if n == m else torch.cat([fq.new_zeros(*fq.shape[:-2], m - n, fq.shape[-1]), fq], -2)


def _band(qf, kf, v1, real, window: int, scaling: float, causal: bool, block: int = 64):
    """The softmax part of the hybrid, a block of queries at a time against the keys their windows can reach:
    Σ_{j∈win(i)} e^{s q_i·k_j - c_i} [v_j, 1] ``[B, H, G, N, E]`` and c_i = max(0, max_j s q_i·k_j) ``[..., 1]``."""
    n, m = qf.shape[-2], kf.shape[-2]
    exact, shifts = [], []
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
        shift = logits.amax(-1, keepdim=True).clamp_min(0.0)
        exact.append((logits - shift).exp() @ v1[:, :, None, lo:hi])
        shifts.append(shift)
    return torch.cat(exact, -2), torch.cat(shifts, -2)


def _augmented(state: LinearState | None) -> torch.Tensor | None:
    """[S, z] ``[B, H, F, Dv + 1]``."""
    return None if state is None else torch.cat([state.S, state.z.unsqueeze(-1)], -1)


def gated_hybrid(q, k, v, fq, fk, log_gate, *, window: int, scaling: float, causal: bool, key_mask=None,
                 state: LinearState | None = None, log_mix: torch.Tensor | None = None,
                 chunk_size: int = GATED_CHUNK):
    """The window hybrid with a gated state (module docstring): ``q`` ``[B, H, G, N, D]`` (grouped), ``k``/``v``
    ``[B, H, M, ·]``; returns the normalised output ``[B, H, G, N, Dv]`` and (causal) the state holding every
    key but the last W - 1, decayed to the last key it holds."""
    fq, fk, log_gate = accum(fq), accum(fk), accum(log_gate)
    qf, kf, vf = accum(q), accum(k), accum(v)
    b_, h, g, n, _ = qf.shape
    m, dv = kf.shape[-2], vf.shape[-1]
    real = torch.ones(b_, m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.to(torch.bool)
    fkm = fk * real[:, None, :, None].to(fk.dtype)
    v1 = with_ones(vf)
    exact, shift = _band(qf, kf, v1, real, window, scaling, causal)
    # the gated part: keys j <= i - W (and j >= i + W bidirectionally) through the shifted keys
    s0 = _augmented(state)
    sk, sv = _shifted(fkm, v1, log_gate, window)
    prefix = m - n
    if causal:
        start = s0
        if prefix:
            start = fold(sk[:, :, :prefix], sv[:, :, :prefix], log_gate[:, :, :prefix], s0)
        far, _ = gated_causal(fq, sk[:, :, prefix:], sv[:, :, prefix:], log_gate[:, :, prefix:], start, chunk_size)
    else:
        fqm = _queries_at_key_positions(fq, m)
        far, _ = gated_causal(fqm, sk, sv, log_gate, None, chunk_size)
        rg = _reverse_gates(log_gate)
        rk, rv = _shifted(fkm.flip(-2), v1.flip(-2), rg, window)
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
