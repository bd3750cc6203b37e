"""A bounded sparse cache for the sliding-window hybrid: per KV head, up to C older key–value pairs that the
linear state reproduces worst are attended exactly, next to the window and the sinks, under one normaliser
(LoLA: McDermott et al. 2025, "LoLA: Low-Rank Linear Attention With Sparse Caching").

The rule, the same in a prefill and in token-by-token decoding, and blind to any later token (question-agnostic):
at every boundary position t (t > 0 a multiple of the block B), before query t is answered,

    candidates  = the real, non-sink keys that left the window since the last boundary (t - B - W < j ≤ t - W)
    pool        = cache ∪ candidates;   S', z' = the state of every other out-of-window key
    score_j     = ‖v_j - S'ᵀφ(k_j) / max(z'·φ(k_j), ρ z·φ(k_j), eps)‖²   (self-recall error: what the state alone
                  returns for k_j; z = z' + the candidates' features, ρ = 1e-3)
    cache       ← the C pool pairs with the largest scores; the others are folded into the state.

Query i then weighs e^{s q_i·k_j} over win(i) ∪ sinks ∪ cache(i) and λ_h φ(q_i)·φ(k_j) over every other key
outside its window. Between boundaries a key leaving the window enters the state at once, so with C = 0 this is
the plain hybrid of :mod:`.window`.

Evaluation: the plain hybrid's unnormalised sums (``raw`` of :func:`.window.hybrid_attention`, from a state that
leaves out the cache held at the start, cache₀) are corrected per segment of queries between two boundaries,
which share one cache: + e^{s q·k} over cache(i), + λ φ(q)·φ(k) over cache₀, - λ φ(q)·φ(k) over cache(i) (a pair in
both cancels), with one shift m_i = max(the hybrid's, the cache logits). The boundaries are a loop of O(N / B)
steps on (C + B)-key pools. Decoding keeps the keys folded since the last boundary (at most B) to score them at the
next one, when S' is the state minus them. The floor ρ z·φ(k_j) says the state knows nothing about k_j when the keys
left in it carry under a thousandth of k_j's feature mass: the difference of two float32 sums is then rounding
noise, and dividing by it made scores noise (and the chosen pairs depend on the order of float operations). The
cache is a fixed number of slots, so its bytes do not grow with the context. Feature maps without a decay whose φ
does not depend on the position (the state must give a pair back exactly when it leaves the cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base import accum
from ..slots import grow_slots
from .spec import HybridCall, HybridInputs, HybridSpec
from .state import SparseCache, with_ones


def _fold(s: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """s + sign · Σ_j weight_j φ(k_j) [v_j, 1]ᵀ; ``s`` ``[B, H, F, Dv + 1]``, ``fk`` ``[B, H, L, F]``, ``weight``
    ``[B, H, L]`` (0 or 1)."""
    return s + sign * ((fk * weight[..., None]).transpose(-1, -2) @ with_ones(v))


MASS_FLOOR = 1e-3  # ρ: below this share of a key's feature mass the state is taken to hold nothing about it


def recall_error(s: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, eps: float,
                 z_full: torch.Tensor | None = None) -> torch.Tensor:
    """‖v_j - Sᵀφ(k_j) / max(zᵀφ(k_j), ρ z_fullᵀφ(k_j), eps)‖² ``[B, H, L]``: how far the state (``s`` = [S, z]
    ``[B, H, F, Dv + 1]``) is from giving back v_j for k_j; ``z_full`` ``[B, H, F]`` the normaliser that ``z`` was
    taken from (ρ = :data:`MASS_FLOOR`)."""
    dv = v.shape[-1]
    read = fk @ (s if z_full is None else torch.cat([s, z_full.unsqueeze(-1)], -1))  # one matmul for every sum
    den = read[..., dv:dv + 1].clamp_min(eps)
    if z_full is not None:
        den = torch.maximum(den, MASS_FLOOR * read[..., dv + 1:])
    return (v - read[..., :dv] / den).square().sum(-1)


def choose_pairs(
    s: torch.Tensor,
    pool: SparseCache,
    feature_k: Callable[[torch.Tensor], torch.Tensor],
    *,
    capacity: int,
    eps: float,
    in_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One boundary: the pool = the cache of ``pool`` (``keys`` ``[B, Hkv, C, D]``, ``values``, ``pos``, ``valid``) ∪
    its pending keys (folded into ``s`` = [S, z] since the last boundary, or with ``in_state`` False not yet;
    ``pending_ok`` ``[B, P]``), scored by the self-recall error against the state without the candidates; the C
    highest are the new cache (the whole pool while it has at most C entries: the cache grows with the keys it
    holds), the rest of the pool is folded into the state. Returns (state, keys, values, pos, valid)."""
    keys, values, pos, valid = pool.keys, pool.values, pool.pos, pool.valid
    pend_k, pend_v, pend_pos, pend_ok = pool.pending_keys, pool.pending_values, pool.pending_pos, pool.pending_ok
    b, hkv = keys.shape[:2]
    d, dv = keys.shape[-1], values.shape[-1]
    cand_ok = pend_ok[:, None, :].expand(-1, hkv, -1)
    pool_k, pool_v = torch.cat([keys, pend_k], 2), torch.cat([values, pend_v], 2)
    pool_f = feature_k(pool_k)
    cand_f = pool_f[:, :, keys.shape[2]:]
    pool_pos = torch.cat([pos, pend_pos.expand(b, hkv, -1)], 2)
    pool_ok = torch.cat([valid, cand_ok], 2)
    if in_state:
        s_out, z_full = _fold(s, cand_f, pend_v, cand_ok.to(s.dtype), sign=-1.0), s[..., dv]  # without the candidates
    else:
        s_out, z_full = s, s[..., dv] + (cand_f * cand_ok[..., None].to(s.dtype)).sum(2)
    score = recall_error(s_out, pool_f, pool_v, eps, z_full=z_full).masked_fill(~pool_ok, float("-inf"))
    order = score.topk(pool_ok.shape[-1], dim=-1).indices  # [B, Hkv, C + P], highest first
    keep = min(capacity, pool_ok.shape[-1])
    pick, out = order[..., :keep], order[..., keep:]
    # the rest of the pool (the P lowest) joins the state
    s = _fold(s_out, pool_f.gather(2, out[..., None].expand(-1, -1, -1, pool_f.shape[-1])),
              pool_v.gather(2, out[..., None].expand(-1, -1, -1, dv)), pool_ok.gather(2, out).to(s.dtype))
    return (s, pool_k.gather(2, pick[..., None].expand(-1, -1, -1, d)),
            pool_v.gather(2, pick[..., None].expand(-1, -1, -1, dv)), pool_pos.gather(2, pick), pool_ok.gather(2, pick))


def sparse_window(
    raw: torch.Tensor,
    top: torch.Tensor,
    x: HybridInputs,
    feature_k: Callable[[torch.Tensor], torch.Tensor],
    spec: HybridSpec,
    call: HybridCall,
) -> tuple[torch.Tensor, torch.Tensor, SparseCache]:
    """The outputs ``[B, Hkv, G, N, Dv]`` of N queries at the last N of M key positions (``k``'s first at
    ``offset``), the state after them (``[B, Hkv, F, Dv + 1]``: every out-of-window key but the cache) and the cache.

    ``raw`` ``[B, Hkv, G, N, Dv + 1]`` and ``top`` ``[B, Hkv, G, N, 1]``: the plain hybrid's unnormalised sums and
    their shift, from ``call.state`` (which holds every key before ``call.offset`` but cache₀, its sparse cache);
    ``x``: ``q`` grouped ``[B, Hkv, G, N, D]``, ``fq`` its features, ``k``, ``v``, ``fk`` φ(k) ``[B, Hkv, M, F]``;
    ``feature_k`` φ of cached keys ``[B, Hkv, L, D]`` (position-free maps); ``spec``: W, C, B, the scale, eps;
    ``call.log_mix``: ln λ ``[Hkv, G]`` or None (λ = 1). A key enters the state and the cache's candidates when it
    is real and no sink."""
    q, fq, k, v, fk = accum(x.q), x.fq, accum(x.k), accum(x.v), x.fk
    window, capacity, block, scaling, eps = spec.window, spec.capacity, spec.block, spec.scaling, spec.eps
    state, offset = call.state, call.offset
    cache = None if state is None else state.sparse
    mix = None if call.log_mix is None else call.log_mix.exp()
    lin_w = torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool, device=k.device)
    if call.key_mask is not None:
        lin_w = call.key_mask.to(torch.bool)
    if call.sinks is not None:
        lin_w = lin_w & ~call.sinks.holds(offset, k.shape[-2])
    b, hkv, g, n, d = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    dtype = raw.dtype
    q, k, v, fk = q.to(dtype), k.to(dtype), v.to(dtype), fk.to(dtype)
    if cache is None:
        cache = SparseCache.empty(k, v)  # no slots yet: they grow with the keys held
    s = fk.new_zeros(b, hkv, fk.shape[-1], dv + 1) if state is None else torch.cat(
        [state.S, state.z.unsqueeze(-1)], -1).to(dtype)
    first_query = offset + m - n
    folded = offset - 1  # every key at a position ≤ folded is in the state, the cache or the pending slots
    pend_k, pend_v = cache.pending_keys.to(dtype), cache.pending_values.to(dtype)
    pend_pos, pend_ok = cache.pending_pos, cache.pending_ok
    keys, values, pos, valid = cache.keys.to(dtype), cache.values.to(dtype), cache.pos, cache.valid
    lin_w = lin_w.to(dtype)

    def fold_to(last: int) -> None:
        """Keys of this call at positions folded + 1 … last enter the state and the pending slots (slot = position
        mod B; at most B since a boundary). The ring grows with the positions folded, to B slots at most. The slots
        are written with ``where`` rather than ``index_copy``: inductor (torch 2.13) reused the pending buffer in
        place while a gather from an earlier concatenation of it was still to be read."""
        nonlocal s, folded, pend_k, pend_v, pend_pos, pend_ok
        if last <= folded:
            return
        lo, hi = folded + 1 - offset, last + 1 - offset
        s = _fold(s, fk[:, :, lo:hi], v[:, :, lo:hi], lin_w[:, None, lo:hi].expand(-1, hkv, -1))
        size = min(block, last + 1)  # positions 0 … last fill slots 0 … last until the ring has B of them
        if pend_pos.shape[0] < size:
            pend_k, pend_v = grow_slots(pend_k, 2, size), grow_slots(pend_v, 2, size)
            pend_pos, pend_ok = grow_slots(pend_pos, 0, size, -1), grow_slots(pend_ok, 1, size, False)
        slot = torch.arange(pend_pos.shape[0], device=k.device)
        latest = last - (last - slot) % block  # the newest position of each slot's class, ≤ last
        hit = latest > folded
        src = (latest - offset).clamp(0, m - 1)
        pend_k = torch.where(hit[:, None], k.index_select(2, src), pend_k)
        pend_v = torch.where(hit[:, None], v.index_select(2, src), pend_v)
        pend_pos = torch.where(hit, latest, pend_pos)
        pend_ok = torch.where(hit, lin_w.index_select(1, src) > 0, pend_ok)
        folded = last

    start_cache = (keys, values, valid)
    segments: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []  # (first query, cache)
    first_boundary = max(block, -(-first_query // block) * block)
    for t in range(first_boundary, offset + m, block):
        fold_to(t - window)
        pool = SparseCache(keys, values, pos, valid, pend_k, pend_v, pend_pos, pend_ok)
        s, keys, values, pos, valid = choose_pairs(s, pool, feature_k, capacity=capacity, eps=eps)
        pend_ok = torch.zeros_like(pend_ok)
        segments.append((t, (keys, values, valid)))
    fold_to(offset + m - window)  # the state after the last query: every key outside the next position's window

    segments.insert(0, (first_query, start_cache))
    out = raw[..., :dv] / raw[..., dv:].clamp_min(torch.finfo(dtype).tiny)
    if len(segments) > 1 or bool(start_cache[2].any()):
        lam = 1.0 if mix is None else mix.to(dtype)[None, :, :, None, None]
        # φ of cache₀, for the segments after a boundary (a decode step between boundaries has none)
        f0 = feature_k(start_cache[0]) * start_cache[2][..., None].to(dtype) if len(segments) > 1 else None
        ends = [t - first_query for t, _ in segments[1:]] + [n]
        for i, ((t, (ck, cv, cvalid)), end) in enumerate(zip(segments, ends, strict=True)):
            a = t - first_query
            if end <= a:
                continue
            qs = q[:, :, :, a:end]
            logits = (qs @ ck.unsqueeze(2).transpose(-1, -2) * scaling).masked_fill(~cvalid[:, :, None, None, :],
                                                                                    float("-inf"))
            shift = top[:, :, :, a:end]
            if logits.shape[-1]:  # (a cache grown with use may hold no pair yet)
                shift = torch.maximum(shift, logits.amax(-1, keepdim=True))
            num = raw[:, :, :, a:end] * (top[:, :, :, a:end] - shift).exp() + (logits - shift).exp() @ with_ones(
                cv).unsqueeze(2)
            if i:  # the hybrid's linear part holds cache₀ out and cache(i) in: swap them
                fqs = fq[:, :, :, a:end].to(dtype)
                fc = feature_k(ck) * cvalid[..., None].to(dtype)
                lin = (fqs @ f0.unsqueeze(2).transpose(-1, -2)) @ with_ones(start_cache[1]).unsqueeze(2) - (
                    fqs @ fc.unsqueeze(2).transpose(-1, -2)) @ with_ones(cv).unsqueeze(2)
                num = num + lam * (-shift).exp() * lin
            out[:, :, :, a:end] = num[..., :dv] / num[..., dv:].clamp_min(torch.finfo(dtype).tiny)
    new = SparseCache(keys, values, pos, valid, pend_k, pend_v, pend_pos, pend_ok)
    return out, s, new
