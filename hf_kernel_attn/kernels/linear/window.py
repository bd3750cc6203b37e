"""Sliding-window hybrid: exact softmax over the W most recent keys, a feature map over the older ones,
one shared normaliser (LoLCATs, Zhang et al. ICLR 2025; Based, Arora et al. ICML 2024):

    out_i = (Σ_{j∈win(i)} e^{s q_i·k_j} v_j + λ_h Σ_{j∉win(i)} w_ij φ(q_i)·φ(k_j) v_j)
            / (Σ_{j∈win(i)} e^{s q_i·k_j}     + λ_h Σ_{j∉win(i)} w_ij φ(q_i)·φ(k_j))

with win(i) = {j : i - W < j ≤ i} (causal) or {j : |i - j| < W} (bidirectional), w_ij = 1 here (a kernel with a
decay runs the gated engine's hybrid, :func:`.gated.gated_hybrid`, the same formula with w_ij its gates) and
λ_h = exp(θ_h) an optional learnable per-head factor (1 otherwise).
With S sinks (StreamingLLM, Xiao et al. ICLR 2024), the first S real keys of each row join the softmax
part of every query that can see them, win(i) ∪ sinks, and leave the feature-map part; the decode state
then holds the sinks' keys and values next to the W - 1 recent ones and the running sums.

Evaluation: positions are cut into chunks of C; with L = ⌈W/C⌉, a query in chunk c has its window and
the feature-map keys closest to it among chunks c-L … c (… c+L bidirectionally), scored explicitly (a band
of (L+1)·C or (2L+1)·C keys per query); every key further away is out of the window and enters through a
running state Σ φ(k)[v, 1]ᵀ of whole chunks. Cost O(N·(W + C)·(D + F) + N·F·Dv); nothing N × N is built.
Numerics: both sums are multiplied by e^{-m_i}, m_i = max(0, max_{j∈win(i)} s q_i·k_j), which cancels
exactly and keeps e^{s q·k - m} ≤ 1 and e^{-m} ≤ 1 in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import accum, ungroup_output
from ..slots import gather_keys, grow_slots, sink_slot_count, sink_slots
from . import cost
from .gated import gated_causal, queries_at_key_positions, reverse_gates, shifted_keys
from .recurrent import accumulate
from .spec import CAUSAL_CALL, HybridCall, HybridInputs, HybridSpec
from .state import LinearState, SinkSet, with_ones


def chunk_length(window: int, chunk_size: int, length: int) -> tuple[int, int]:
    """(C, L): chunks of C positions, and L = ⌈W / C⌉ earlier chunks that can hold keys of a query's window.
    The band of a query is L + 1 chunks (2L + 1 bidirectionally), W + C keys or fewer. A smaller C wastes less
    of the band on keys outside the window but makes smaller matmuls; C = W clamped to [16, chunk_size]
    (measured on CPU at W = 64, 16k tokens: C = 64 beats 32 and 16). A window covering the sequence is one
    chunk."""
    if window >= length:
        return max(1, length), 1
    c = max(1, min(max(16, window), chunk_size, length))
    return c, -(-window // c)


def update_sinks(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, count: int, offset: int,
                 previous: SinkSet | None) -> SinkSet:
    """The sinks after keys ``k``/``v`` ``[B, Hkv, M, ·]`` at positions offset … offset + M - 1 (``key_mask``
    ``[B, M]``, None = all real): slots still empty in ``previous`` take the real keys of rank 1 … ``count``
    among the keys not seen before (positions ≥ previous.seen). The slots grow with the keys seen (at most
    ``count``), so a large ``count`` costs nothing until that many tokens came."""
    b, h, m, _ = k.shape
    real = torch.ones(b, m, dtype=torch.bool, device=k.device) if key_mask is None else key_mask.to(torch.bool)
    start = 0 if previous is None else min(m, max(0, previous.seen - offset))
    slots = sink_slot_count(count, offset + m)
    if previous is None:
        previous = SinkSet(k.new_zeros(b, h, slots, k.shape[-1]), v.new_zeros(b, h, slots, v.shape[-1]),
                           torch.zeros(b, slots, dtype=torch.long, device=k.device),
                           torch.zeros(b, slots, dtype=torch.bool, device=k.device),
                           torch.zeros(b, dtype=torch.long, device=k.device), 0)
    elif previous.keys.shape[-2] < slots:
        previous = SinkSet(grow_slots(previous.keys, 2, slots), grow_slots(previous.values, 2, slots),
                           grow_slots(previous.pos, 1, slots), grow_slots(previous.valid, 1, slots, False),
                           previous.real_seen, previous.seen)
    new_real = real[:, start:]
    if new_real.shape[1] == 0:
        return previous
    idx, pos, fresh = sink_slots(new_real, previous.keys.shape[-2], offset=offset + start, seen=previous.real_seen)
    kn, vn = k[:, :, start:], v[:, :, start:]
    sel = fresh[:, None, :, None]
    return SinkSet(torch.where(sel, gather_keys(kn, idx).to(previous.keys.dtype), previous.keys),
                   torch.where(sel, gather_keys(vn, idx).to(previous.values.dtype), previous.values),
                   torch.where(fresh, pos, previous.pos), previous.valid | fresh,
                   previous.real_seen + new_real.long().sum(-1), max(previous.seen, offset + m))


def hybrid_attention(x: HybridInputs, spec: HybridSpec,
                     call: HybridCall = CAUSAL_CALL) -> tuple[torch.Tensor, LinearState | None]:
    """The hybrid of the module docstring for N queries at the last N of M key positions (``x`` the inputs,
    ``spec`` W, the scale and the chunk size, ``call`` the rest, as named below).

    ``q`` ``[B, Hkv, G, N, D]`` (grouped), ``k`` ``[B, Hkv, M, D]``, ``v`` ``[B, Hkv, M, Dv]``, features ``fq``
    ``[B, Hkv, G, N, F]`` and ``fk`` ``[B, Hkv, M, F]``; ``state`` holds the keys before ``k`` (causal);
    ``log_mix`` ``[Hkv, G]`` is ln λ. Returns ``[B, N, Hq, Dv]`` in q's dtype and, with
    ``need_state`` (causal), the state of every key that is outside the window of the next position
    (positions ≤ M - W), i.e. all but the last W - 1 keys. ``blocked`` bounds temporaries (no autograd).
    ``sinks`` (keys at absolute positions, k's first key at ``offset``): softmax keys for every query that can
    see them, left out of the feature-map part (and the state). ``raw``: instead of the outputs, the unnormalised
    sums ``[B, Hkv, G, N, Dv + 1]`` (numerator, denominator) scaled by e^{-m_i}, and m_i ``[B, Hkv, G, N, 1]``, in the
    accumulation dtype (:mod:`.sparse_cache` adds its exact keys to them).
    """
    q, k, v, fq, fk = x.q, x.k, x.v, x.fq, x.fk
    window, scaling, chunk_size = spec.window, spec.scaling, spec.chunk_size
    causal, key_mask, state, log_mix, sinks, offset = (call.causal, call.key_mask, call.state, call.log_mix,
                                                       call.sinks, call.offset)
    need_state, blocked, raw = call.need_state, call.blocked, call.raw
    if causal and q.shape[-2] == 1 and k.shape[-2] <= window:  # a decode step: every key is in the window
        return _one_query(x, spec, call)
    out_dtype = q.dtype
    q, k, v, fq, fk = accum(q), accum(k), accum(v), accum(fq), accum(fk)
    b, hkv, g, n, _ = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    kw = torch.ones(b, m, dtype=q.dtype, device=q.device) if key_mask is None else key_mask.to(q.dtype)
    lin_w = kw  # the weight of each key in the feature-map part: 0 for padding and for the sinks
    if sinks is not None:
        lin_w = kw * (~sinks.holds(offset, m)).to(kw.dtype)
    masked = key_mask is not None or sinks is not None
    if causal:
        fold = max(0, m - n - window + 1)  # keys outside every query's window: straight into the state
        if fold:
            state = accumulate(fk[:, :, :fold] * lin_w[:, None, :fold, None], v[:, :, :fold], state)
            k, v, fk, kw, lin_w = k[:, :, fold:], v[:, :, fold:], fk[:, :, fold:], kw[:, fold:], lin_w[:, fold:]
            m -= fold
            offset += fold
    elif state is not None:
        raise ValueError("a bidirectional window hybrid takes no state")
    state_in = state
    prefix = m - n
    length = m
    c, lag = chunk_length(window, chunk_size, length)
    chunks = -(-length // c)
    padded = chunks * c
    # queries padded on the left to align with the keys (those rows are dropped), everything padded on the
    # right to whole chunks, keys padded by L empty chunks on each side (the neighbours of the edge chunks)
    if prefix or padded > length:
        q = F.pad(q, (0, 0, prefix, padded - length))
        fq = F.pad(fq, (0, 0, prefix, padded - length))
    pads = (0, 0, lag * c, padded - length + lag * c)
    kp = F.pad(k, pads).mul_(scaling)  # s k: the logits come straight from one matmul
    fkp = F.pad(fk * lin_w[:, None, :, None] if masked else fk, pads)
    vp = F.pad(with_ones(v), pads)
    kwp = F.pad(kw, pads[2:])
    nf = fkp.shape[-1]
    x = chunks + 2 * lag
    parts = lag + 1 if causal else 2 * lag + 1  # the band of query chunk c: key chunks c - L ... c (... c + L)
    width = parts * c
    # per (batch, KV head) the band of every query chunk is a strided view of the padded keys (unfold with
    # step C), which batched matmuls read in place; each query head's chunks are a view of q
    qc = q.reshape(b, hkv, g, chunks, c, -1)
    fqc = fq.reshape(b, hkv, g, chunks, c, nf)

    fkc = fkp.view(b, hkv, x, c, nf)  # φ(k), zero for padded keys
    vc = vp.view(b, hkv, x, c, dv + 1)
    # prefix states P[c]: the keys of chunks ≤ c - L - 1 (padded chunks < c), from the chunk sums U[p] over the
    # padded chunks p: P[c] = P[c - 1] + U[c - 1]
    u = fkc.transpose(-1, -2) @ vc  # [B, Hkv, X, F, Dv + 1]
    s0 = None if state_in is None else torch.cat([state_in.S, state_in.z.unsqueeze(-1)], -1)
    prefix_states = _running(u[:, :, :chunks], s0)  # [B, Hkv, chunks, F, Dv + 1]
    suffix_states = None
    if not causal:
        # R[c] = Σ_{p ≥ c+2L+1} U[p]: the keys of chunks ≥ c + L + 1
        suffix_states = _running(u[:, :, 2 * lag + 1:].flip(2), None, inclusive=True).flip(2)
        suffix_states = F.pad(suffix_states, (0, 0, 0, 0, 0, chunks - suffix_states.shape[2]))

    a_idx = torch.arange(c, device=q.device)[:, None]
    b_idx = torch.arange(width, device=q.device)[None, :]
    dist = a_idx - b_idx + lag * c  # query position - key position
    in_window = (dist >= 0) & (dist < window) if causal else dist.abs() < window  # [C, W']
    outside = dist >= window if causal else dist.abs() >= window
    hidden = ~in_window
    # the kernel scores are needed only in the columns that hold a key outside some query's window
    lo, hi = _outside_span(c, width, lag, window, causal)
    band_weight = outside[:, lo:hi].to(q.dtype).expand(hkv, -1, -1)
    mix = None if log_mix is None else log_mix.to(q.dtype).exp()  # [Hkv, G]

    tiny = torch.finfo(q.dtype).tiny

    # every (batch, KV head, chunk) at once, the G query heads of a KV head stacked as the rows of its chunk (so no
    # operand is broadcast over G and the backward has no G-sums); the bands are strided views of the padded keys
    # (unfold with step C). Without autograd ``blocked`` takes the chunks a block at a time (bounded temporaries):
    # the same batched matmuls on fewer batch entries, so the numbers do not depend on the grad mode.
    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, G, nc, C, ·] -> [B, Hkv, nc, G·C, ·]
        return x.transpose(2, 3).reshape(b, hkv, chunks, g * c, x.shape[-1])

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [Hkv, C, ·] -> [1, Hkv, 1, G·C, ·]
        return t.repeat(1, g, 1).unsqueeze(1).unsqueeze(0)

    q_rows, f_rows = rows(qc), rows(fqc)
    k_bands = kp.unfold(2, width, c)  # [B, Hkv, ≥nc, D, W']
    fk_bands = fkp.unfold(2, width, c)[..., lo:hi]  # [B, Hkv, ≥nc, F, cols]
    v_bands = vp.unfold(2, width, c).transpose(-1, -2)  # [B, Hkv, ≥nc, W', Dv + 1]
    real_bands = None if key_mask is None else kwp.unfold(1, width, c)[:, None, :, None] > 0  # [B, 1, ≥nc, 1, W']
    hidden_rows = hidden.repeat(g, 1)
    weight_rows = per_row(band_weight)
    mix_rows = None if mix is None else mix.repeat_interleave(c, 1).view(1, hkv, 1, g * c, 1)
    sink_k = sink_v = sink_seen = None
    if sinks is not None:
        sink_k = (accum(sinks.keys) * scaling).transpose(-1, -2).unsqueeze(2)  # [B, Hkv, 1, D, S]
        sink_v = with_ones(accum(sinks.values)).unsqueeze(2)  # [B, Hkv, 1, S, Dv + 1]
        # query (padded index t = key position t here) against each sink: seen through the sink columns when the
        # sink is visible and outside the query's window (inside it, the band holds it)
        ds = torch.arange(padded, device=q.device)[None, :, None] - (sinks.pos - offset)[:, None, :]  # [B, T, S]
        sink_seen = ((ds >= window) if causal else (ds.abs() >= window)) & sinks.valid[:, None, :]
        sink_seen = sink_seen.view(b, chunks, 1, c, -1).expand(-1, -1, g, -1, -1).reshape(b, 1, chunks, g * c, -1)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, fq, fk, s0, log_mix, sink_k, sink_v)
                                           if t is not None)
    step = chunks if grad or not blocked else cost.band_block(b * hkv * g * c * width)
    outs = []
    for c0 in range(0, chunks, step):
        c1 = min(chunks, c0 + step)
        logits = q_rows[:, :, c0:c1] @ k_bands[:, :, c0:c1]  # [B, Hkv, nb, G·C, W'], s q·k
        mask = hidden_rows if real_bands is None else hidden_rows | ~real_bands[:, :, c0:c1]
        logits = logits.masked_fill(mask, float("-inf"))
        top = logits.amax(-1, keepdim=True)
        sink_logits = None
        if sink_k is not None:
            sink_logits = (q_rows[:, :, c0:c1] @ sink_k).masked_fill(~sink_seen[:, :, c0:c1], float("-inf"))
            top = torch.maximum(top, sink_logits.amax(-1, keepdim=True))
        top = top.clamp_min(0).detach()
        far_scale = torch.exp(-top)
        if mix_rows is not None:
            far_scale = far_scale * mix_rows
        fr = f_rows[:, :, c0:c1]
        far = fr @ prefix_states[:, :, c0:c1]
        if suffix_states is not None:
            far = far + fr @ suffix_states[:, :, c0:c1]
        vb = v_bands[:, :, c0:c1]
        o = far * far_scale + torch.exp(logits - top) @ vb
        if sink_logits is not None:
            o = o + torch.exp(sink_logits - top) @ sink_v
        if hi > lo:
            o = o + ((fr @ fk_bands[:, :, c0:c1]) * weight_rows * far_scale) @ vb[..., lo:hi, :]
        if raw:
            outs.append(torch.cat([o, top.expand(*o.shape[:-1], 1)], -1))
        else:
            outs.append(o[..., :dv] / o[..., dv:].clamp_min(tiny))
    o = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    if raw:
        sums = o.view(b, hkv, chunks, g, c, dv + 2).transpose(2, 3).reshape(b, hkv, g, padded, dv + 2)
        sums = sums[:, :, :, prefix:prefix + n]
        return sums[..., :dv + 1], sums[..., dv + 1:]
    out = o.view(b, hkv, chunks, g, c, dv).transpose(2, 3)
    res = ungroup_output(out.reshape(b, hkv, g, padded, dv)[:, :, :, prefix:prefix + n])
    res = res.to(out_dtype)
    if not (causal and need_state):
        return res, None
    keep = max(0, min(length, window - 1))
    done = length - keep
    new_state = state_in
    if done > 0 or new_state is None:
        new_state = accumulate(fk[:, :, :done] * lin_w[:, None, :done, None], v[:, :, :done], state_in)
    return res, new_state


def _one_query(x: HybridInputs, spec: HybridSpec, call: HybridCall):
    """:func:`hybrid_attention` for one causal query whose window holds all M ≤ W keys (a decode step): the
    softmax part over those keys and the sinks outside the window, the feature-map part φ(q)·[S, z] of the state,
    with no chunking (the same formula and shift m)."""
    q, k, v, fq, fk = x.q, x.k, x.v, x.fq, x.fk
    window, scaling = spec.window, spec.scaling
    key_mask, state, log_mix, sinks, offset = call.key_mask, call.state, call.log_mix, call.sinks, call.offset
    need_state, raw = call.need_state, call.raw
    out_dtype = q.dtype
    q, k, v, fq, fk = accum(q), accum(k), accum(v), accum(fq), accum(fk)
    b, hkv, g, _, _ = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    real = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.to(torch.bool)
    lin_w = real
    logits = (q @ k.unsqueeze(2).transpose(-1, -2) * scaling).masked_fill(~real[:, None, None, None, :],
                                                                           float("-inf"))  # [B, Hkv, G, 1, M]
    top = logits.amax(-1, keepdim=True)
    sink_logits = None
    if sinks is not None:
        lin_w = real & ~sinks.holds(offset, m)
        seen = ((offset + m - 1 - sinks.pos) >= window) & sinks.valid  # [B, S]: outside the window, visible
        sink_logits = (q @ (accum(sinks.keys) * scaling).unsqueeze(2).transpose(-1, -2)).masked_fill(
            ~seen[:, None, None, None, :], float("-inf"))
        top = torch.maximum(top, sink_logits.amax(-1, keepdim=True))
    top = top.clamp_min(0).detach()
    o = torch.exp(logits - top) @ with_ones(v).unsqueeze(2)
    if sink_logits is not None:
        o = o + torch.exp(sink_logits - top) @ with_ones(accum(sinks.values)).unsqueeze(2)
    if state is not None:
        far = fq @ torch.cat([state.S, state.z.unsqueeze(-1)], -1).unsqueeze(2)  # [B, Hkv, G, 1, Dv + 1]
        scale = torch.exp(-top)
        if log_mix is not None:
            scale = scale * log_mix.to(q.dtype).exp()[None, :, :, None, None]
        o = o + far * scale
    new_state = None
    if need_state:
        done = m - min(m, window - 1)  # keys outside the next position's window
        new_state = state
        if done > 0 or new_state is None:
            new_state = accumulate(fk[:, :, :done] * lin_w[:, None, :done, None].to(fk.dtype), v[:, :, :done], state)
    if raw:
        return o, top
    out = ungroup_output(o[..., :dv] / o[..., dv:].clamp_min(torch.finfo(o.dtype).tiny))
    return out.to(out_dtype), new_state


def _outside_span(c: int, width: int, lag: int, window: int, causal: bool) -> tuple[int, int]:
    """[lo, hi): the band columns holding a key outside the window of some query of the chunk, from the
    integers alone (query a, column b: distance a - b + L·C), so that no tensor is read back (torch.compile)."""
    cols = [col for col in range(width)
            if c - 1 - col + lag * c >= window or (not causal and lag * c - col <= -window)]
    return (cols[0], cols[-1] + 1) if cols else (0, 0)


def _running(u: torch.Tensor, s0: torch.Tensor | None, inclusive: bool = False) -> torch.Tensor:
    """Running sums over the chunks (dim 2; dim 1 is the KV head), added one at a time (the same in every grad
    mode; a cumsum sums in another order): exclusive, out[0] = s0 (or 0), out[x] = out[x - 1] + u[x - 1]; or
    ``inclusive`` from 0, out[x] = out[x - 1] + u[x]."""
    if u.shape[2] == 0:
        return u
    outs = []
    acc = torch.zeros_like(u[:, :, 0]) if s0 is None or inclusive else s0
    for i in range(u.shape[2]):
        if inclusive:
            acc = acc + u[:, :, i]
        outs.append(acc)
        if not inclusive:
            acc = acc + u[:, :, i]
    return torch.stack(outs, 2)


def branch_normalisers(
    q: torch.Tensor,
    k: torch.Tensor,
    fq: torch.Tensor,
    fk: torch.Tensor,
    spec: HybridSpec,
    call: HybridCall = CAUSAL_CALL,
    log_gate: torch.Tensor | None = None,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two parts of the hybrid's normaliser for every query, written out (O(N·M), a diagnostic):
    window_i = Σ_{j∈win(i)} e^{s q_i·k_j - m_i} and far_i = λ_h Σ_{j∉win(i)} Σ_f φ_f(q_i) w_ij,f φ_f(k_j) e^{-m_i} (the
    first ``sinks`` real keys count as window keys; w = 1, or the decay of the gates ``log_gate`` ``[B, Hkv, M, Γ]``,
    taken from the gated scan of the keys W positions back, as the gated hybrid does), with
    m_i as in :func:`hybrid_attention` (the shares far / (window + far) do not depend on it). Shapes as
    :func:`hybrid_attention` (``q`` grouped ``[B, Hkv, G, N, D]``, no state; ``spec``: W, the scale and the count
    of sinks; ``call``: ``causal``, ``key_mask``, ``log_mix``); returns two ``[B, Hkv, G, N]``."""
    window, scaling, sinks = spec.window, spec.scaling, spec.sinks
    causal, key_mask, log_mix = call.causal, call.key_mask, call.log_mix
    q, k, fq, fk = accum(q), accum(k), accum(fq), accum(fk)
    n, m = q.shape[-2], k.shape[-2]
    real = None if key_mask is None else key_mask.to(torch.bool)[:, None, None, None, :]  # [B, 1, 1, 1, M]
    sink = None  # [B, 1, 1, 1, M]: the first ``sinks`` real keys, in the softmax part
    if sinks:
        flags = torch.ones(q.shape[0], m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
        sink = (flags & (flags.long().cumsum(-1) <= sinks))[:, None, None, None, :]
    mix = None if log_mix is None else log_mix.to(q.dtype).exp()[None, :, :, None]  # [1, Hkv, G, 1]
    gated_far = None
    if log_gate is not None:
        weight = torch.ones(q.shape[0], 1, m, 1, dtype=fk.dtype, device=q.device)
        if real is not None:
            weight = weight * real[:, 0, 0, 0, :, None]
        if sink is not None:
            weight = weight * ~sink[:, 0, 0, 0, :, None]
        gated_far = _gated_far(fq, fk * weight, accum(log_gate), window, causal)
    j = torch.arange(m, device=q.device)
    wins, fars = [], []
    for start in range(0, n, block):
        i = torch.arange(start, min(n, start + block), device=q.device)[:, None] + (m - n)
        dist = i - j[None, :]  # query position - key position, [nb, M]
        visible = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
        in_window = visible & (dist.abs() < window)
        if sink is not None:
            in_window = in_window | (visible & sink)
        outside = visible & ~in_window
        if real is not None:
            in_window, outside = in_window & real, outside & real
        logits = (q[..., start:start + block, :] @ k.unsqueeze(2).transpose(-1, -2)) * scaling  # [B, Hkv, G, nb, M]
        logits = logits.masked_fill(~in_window, float("-inf"))
        top = logits.amax(-1, keepdim=True).clamp_min(0)
        win = torch.exp(logits - top).sum(-1)
        if gated_far is None:
            scores = fq[..., start:start + block, :] @ fk.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, nb, M]
            far = (scores * outside).sum(-1)
        else:
            far = gated_far[..., start:start + block]
        far = far * torch.exp(-top[..., 0])
        wins.append(win)
        fars.append(far if mix is None else far * mix)
    return torch.cat(wins, -1), torch.cat(fars, -1)


def _gated_far(fq: torch.Tensor, fk: torch.Tensor, log_gate: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Σ_{j ∉ win(i)} Σ_f φ_f(q_i) e^{-|b_i - b_j|_f} φ_f(k_j) ``[B, Hkv, G, N]`` for the last N of M positions: the
    gated scan of the keys W positions back (and, bidirectionally, W positions ahead)."""
    n, m = fq.shape[-2], fk.shape[-2]
    ones = fk.new_ones(*fk.shape[:-1], 1)
    fqm = queries_at_key_positions(fq, m)
    sk, sv = shifted_keys(fk, ones, log_gate, window)
    far, _ = gated_causal(fqm, sk, sv, log_gate, None)
    if not causal:
        rg = reverse_gates(log_gate)
        rk, rv = shifted_keys(fk.flip(-2), ones, rg, window)
        back, _ = gated_causal(fqm.flip(-2), rk, rv, rg, None)
        far = far + back.flip(-2)
    return far[..., m - n:, 0]
