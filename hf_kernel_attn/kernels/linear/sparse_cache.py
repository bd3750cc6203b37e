"""A bounded sparse cache for the sliding-window hybrid: per KV head, up to C older key–value pairs that the
linear state reproduces worst are attended exactly, next to the window and the sinks, under one normaliser
(LoLA: McDermott et al. 2025, "LoLA: Low-Rank Linear Attention With Sparse Caching").

The rule, the same in a prefill and in token-by-token decoding, and blind to any later token (question-agnostic):
at every boundary position t (t > 0 a multiple of the block B), before query t is answered,

    candidates  = the real, non-sink keys that left the window since the last boundary (t - B - W < j ≤ t - W)
    pool        = cache ∪ candidates;   S', z' = the state of every other out-of-window key
    score_j     = ‖v_j - S'ᵀφ(k_j) / max(z'·φ(k_j), eps)‖²   (self-recall error: what the state alone returns for k_j)
    cache       ← the C pool pairs with the largest scores; the others are folded into the state.

Query i then weighs e^{s q_i·k_j} over win(i) ∪ sinks ∪ cache(i) and λ_h φ(q_i)·φ(k_j) over every other key
outside its window. Between boundaries a key leaving the window is read through the feature map at once, so with
C = 0 this is the plain hybrid of :mod:`.window`.

Evaluation: the plain hybrid's unnormalised sums (``raw`` of :func:`.window.hybrid_attention`, from a state that
leaves out the cache held at the start, cache₀) are corrected per segment of queries between two boundaries,
which share one cache: + e^{s q·k} over cache(i), + λ φ(q)·φ(k) over cache₀, - λ φ(q)·φ(k) over cache(i) (a pair in
both cancels), with one shift m_i = max(the hybrid's, the cache logits). The boundaries are a loop of O(N / B)
steps on (C + B)-key pools. The keys that left the window since the last boundary (at most B, the candidates of
the next one) wait in pending slots, outside the returned state, and each call adds them to the state it reads
(:func:`with_pending`): S' is then a sum that only grows, never a state minus its candidates, whose float32
rounding divided by a small z'·φ(k) made a score noise. The cache is a fixed number of slots, so its bytes do not
grow with the context. Feature maps without a decay whose φ does not depend on the position (the state must give
a pair back exactly when it leaves the cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .state import LinearState, SparseCache, with_ones


def _fold(s: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """s + Σ_j weight_j φ(k_j) [v_j, 1]ᵀ; ``s`` ``[B, H, F, Dv + 1]``, ``fk`` ``[B, H, L, F]``, ``weight``
    ``[B, H, L]`` (0 or 1)."""
    return s + (fk * weight[..., None]).transpose(-1, -2) @ with_ones(v)


def with_pending(state: LinearState, feature_k: Callable[[torch.Tensor], torch.Tensor]) -> LinearState:
    """The state that the hybrid's feature-map part reads: ``state`` (which leaves out the sparse cache and the
    pending keys, the real keys that left the window since the last boundary) plus the pending keys."""
    cache = state.sparse
    if cache is None:
        return state
    h = cache.pending_keys.shape[1]
    s = _fold(torch.cat([state.S, state.z.unsqueeze(-1)], -1), feature_k(cache.pending_keys).to(state.S.dtype),
              cache.pending_values.to(state.S.dtype), cache.pending_ok[:, None, :].expand(-1, h, -1).to(state.S.dtype))
    dv = state.S.shape[-1]
    return LinearState(s[..., :dv], s[..., dv], state.sinks, state.exact, cache)


def recall_error(s: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """‖v_j - Sᵀφ(k_j) / max(zᵀφ(k_j), eps)‖² ``[B, H, L]``: how far the state (``s`` = [S, z] ``[B, H, F, Dv + 1]``)
    is from giving back v_j for k_j."""
    read = fk @ s
    dv = v.shape[-1]
    return (v - read[..., :dv] / read[..., dv:].clamp_min(eps)).square().sum(-1)


def sparse_window(
    raw: torch.Tensor,
    top: torch.Tensor,
    q: torch.Tensor,
    fq: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fk: torch.Tensor,
    lin_w: torch.Tensor,
    state: LinearState | None,
    cache: SparseCache | None,
    feature_k: Callable[[torch.Tensor], torch.Tensor],
    *,
    window: int,
    capacity: int,
    block: int,
    scaling: float,
    offset: int,
    mix: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, SparseCache]:
    """The outputs ``[B, Hkv, G, N, Dv]`` of N queries at the last N of M key positions (``k``'s first at
    ``offset``), the state after them (``[B, Hkv, F, Dv + 1]``: every out-of-window key but the cache and the
    pending keys) and the cache.

    ``raw`` ``[B, Hkv, G, N, Dv + 1]`` and ``top`` ``[B, Hkv, G, N, 1]``: the plain hybrid's unnormalised sums and
    their shift, from ``with_pending(state)``; ``state`` holds every key before ``offset`` but cache₀ = ``cache``
    and its pending keys; ``q`` grouped
    ``[B, Hkv, G, N, D]``, ``fq`` its features, ``fk`` φ(k) ``[B, Hkv, M, F]``, ``lin_w`` ``[B, M]`` 1 for a real
    non-sink key; ``feature_k`` φ of cached keys ``[B, Hkv, L, D]`` (position-free maps); ``mix`` λ ``[Hkv, G]``
    or None (1)."""
    b, hkv, g, n, d = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    dtype = raw.dtype
    q, k, v, fk = q.to(dtype), k.to(dtype), v.to(dtype), fk.to(dtype)
    if cache is None:
        cache = SparseCache.empty(k, v, capacity, block)
    s = fk.new_zeros(b, hkv, fk.shape[-1], dv + 1) if state is None else torch.cat(
        [state.S, state.z.unsqueeze(-1)], -1).to(dtype)
    first_query = offset + m - n
    folded = offset - 1  # every key at a position ≤ folded is in the state, the cache or the pending slots
    pend_k, pend_v = cache.pending_keys.to(dtype), cache.pending_values.to(dtype)
    pend_pos, pend_ok = cache.pending_pos, cache.pending_ok
    keys, values, pos, valid = cache.keys.to(dtype), cache.values.to(dtype), cache.pos, cache.valid
    lin_w = lin_w.to(dtype)

    slot = torch.arange(block, device=k.device)

    def fold_to(last: int) -> None:
        """Keys of this call at positions folded + 1 … last enter the pending slots (slot = position mod B; at most
        B since a boundary). Written with ``where`` rather than ``index_copy``: inductor (torch 2.13) reused the
        pending buffer in place while a gather from an earlier concatenation of it was still to be read."""
        nonlocal folded, pend_k, pend_v, pend_pos, pend_ok
        if last <= folded:
            return
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
        cand_ok = pend_ok[:, None, :].expand(-1, hkv, -1)
        cand_f = feature_k(pend_k)
        pool_k, pool_v = torch.cat([keys, pend_k], 2), torch.cat([values, pend_v], 2)
        pool_f = torch.cat([feature_k(keys), cand_f], 2)
        pool_pos = torch.cat([pos, pend_pos.expand(b, hkv, -1)], 2)
        pool_ok = torch.cat([valid, cand_ok], 2)
        score = recall_error(s, pool_f, pool_v, eps).masked_fill(~pool_ok, float("-inf"))
        pick = score.topk(capacity, dim=-1).indices  # [B, Hkv, C]
        kept = torch.zeros_like(pool_ok).scatter_(-1, pick, True)
        s = _fold(s, pool_f, pool_v, (pool_ok & ~kept).to(dtype))  # the rest of the pool joins the state
        keys = pool_k.gather(2, pick[..., None].expand(-1, -1, -1, d))
        values = pool_v.gather(2, pick[..., None].expand(-1, -1, -1, dv))
        pos, valid = pool_pos.gather(2, pick), pool_ok.gather(2, pick)
        pend_ok = torch.zeros_like(pend_ok)
        segments.append((t, (keys, values, valid)))
    fold_to(offset + m - window)  # the keys outside the next position's window since the last boundary

    segments.insert(0, (first_query, start_cache))
    out = raw[..., :dv] / raw[..., dv:].clamp_min(torch.finfo(dtype).tiny)
    if len(segments) > 1 or bool(start_cache[2].any()):
        lam = 1.0 if mix is None else mix.to(dtype)[None, :, :, None, None]
        f0 = feature_k(start_cache[0]) * start_cache[2][..., None].to(dtype)
        ends = [t - first_query for t, _ in segments[1:]] + [n]
        for i, ((t, (ck, cv, cvalid)), end) in enumerate(zip(segments, ends, strict=True)):
            a = t - first_query
            if end <= a:
                continue
            qs = q[:, :, :, a:end]
            logits = (qs @ ck.unsqueeze(2).transpose(-1, -2) * scaling).masked_fill(~cvalid[:, :, None, None, :],
                                                                                    float("-inf"))
            shift = torch.maximum(top[:, :, :, a:end], logits.amax(-1, keepdim=True))
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
