"""The float64 brute force of a feature-map kernel's sliding-window hybrid with attention sinks, a bounded sparse
cache and exact heads (the options ``window``, ``window_mix``, ``sinks``, ``sparse_cache``, ``sparse_block`` and
``softmax_heads`` of ``LinearOptions``), evaluated from the definition:

    out_i = Σ_{j visible} w_ij v_j / Σ_{j visible} w_ij,
    w_ij  = e^{s q_i·k_j}   if j ∈ win(i) ∪ sinks ∪ cache(i)          (win(i): i - W < j ≤ i, or |i - j| < W)
            λ_h κ_ij        otherwise                                 (κ the kernel's ``scores``, λ_h = e^{θ_h} or 1)

sinks = the first S real keys of the row; cache(i) = per KV head, the cache chosen at the last boundary t ≤ i
(t > 0 a multiple of the block B), before query t is answered, from

    candidates = the real, non-sink keys with t - B - W < j ≤ t - W;   pool = cache ∪ candidates
    S', z'     = Σ φ(k_j) v_jᵀ, Σ φ(k_j) over every other real, non-sink key j ≤ t - W (recomputed from scratch)
    score_j    = ‖v_j - S'ᵀφ(k_j) / max(z'·φ(k_j), ρ (z' + Σ_cand φ(k_c))·φ(k_j), eps)‖²,   ρ = 1e-3
    cache      ← the C pool keys with the largest scores

(LoLA, McDermott et al. 2025; the module docstring of ``hf_kernel_attn.kernels.linear.sparse_cache``). A query head
in ``softmax_heads`` is exact over every visible key without a cache, and has λ = 0 (the window, sinks and cache
alone) with one. The cache is kept as a *set* of positions by a Python loop, with no running state; it shares only
φ (``features``) and κ (``scores``) with the kernel, never its forms. The sparse cache is causal only: a
bidirectional call is refused with ``ValueError``, as the kernel refuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

RHO = 1e-3  # the documented floor: below this share of a key's feature mass the state holds nothing about it
f64 = torch.float64


@dataclasses.dataclass(frozen=True)
class HybridRule:
    """The options the reference evaluates: window W, S sinks, C cached pairs chosen every ``block`` positions,
    the normaliser floor ``eps`` and the exact ``softmax_heads``."""

    window: int
    sinks: int = 0
    capacity: int = 0
    block: int = 16
    eps: float = 1e-6
    softmax_heads: tuple[int, ...] = ()

    @classmethod
    def of(cls, options: Any) -> HybridRule:
        """The rule of a kernel's options (``LinearOptions`` or a subclass; missing fields take their defaults)."""
        return cls(window=getattr(options, "window", 0), sinks=getattr(options, "sinks", 0),
                   capacity=getattr(options, "sparse_cache", 0), block=getattr(options, "sparse_block", 16),
                   eps=getattr(options, "eps", 1e-6), softmax_heads=tuple(getattr(options, "softmax_heads", ())))


def sink_positions(real: torch.Tensor, count: int) -> list[frozenset[int]]:
    """Per row of ``real`` ``[B, M]`` (True = a real token): the positions of its first ``count`` real keys."""
    return [frozenset([j for j in range(real.shape[1]) if real[r, j]][:count]) for r in range(real.shape[0])]


def choose_cache(fk: torch.Tensor, v: torch.Tensor, usable: list[bool], cache: frozenset[int], t: int,
                 rule: HybridRule) -> frozenset[int]:
    """The cache after boundary ``t`` of one row and KV head: ``fk`` ``[M, F]`` φ(k), ``v`` ``[M, Dv]``, ``usable``
    the real non-sink keys, ``cache`` the one before (module docstring)."""
    edge = t - rule.window  # keys j ≤ edge have left the window of query t
    cands = {j for j in range(max(0, edge - rule.block + 1), edge + 1) if usable[j]}
    pool = cache | cands
    s_mat = torch.zeros(fk.shape[-1], v.shape[-1], dtype=f64)
    z = torch.zeros(fk.shape[-1], dtype=f64)
    for j in range(edge + 1):
        if usable[j] and j not in pool:
            s_mat = s_mat + torch.outer(fk[j], v[j])
            z = z + fk[j]
    z_full = z + sum((fk[j] for j in cands), torch.zeros_like(z))
    scores = {}
    for j in pool:
        den = max(float(fk[j] @ z), RHO * float(fk[j] @ z_full), rule.eps)
        scores[j] = float((v[j] - (fk[j] @ s_mat) / den).square().sum())
    return frozenset(sorted(pool, key=lambda j: -scores[j])[:rule.capacity])


def cache_history(fk: torch.Tensor, v: torch.Tensor, real: torch.Tensor, rule: HybridRule) -> list[list[list]]:
    """``[B][Hkv][M]``: the set of cached positions that a query at each position weighs exactly; ``fk``
    ``[B, Hkv, M, F]``, ``v`` ``[B, Hkv, M, Dv]``, ``real`` ``[B, M]``."""
    fk, v = fk.detach().to(f64), v.detach().to(f64)
    sinks = sink_positions(real, rule.sinks)
    history = []
    for r in range(fk.shape[0]):
        usable = [bool(real[r, j]) and j not in sinks[r] for j in range(fk.shape[2])]
        rows = []
        for h in range(fk.shape[1]):
            cache: frozenset[int] = frozenset()
            held = []
            for t in range(fk.shape[2]):
                if rule.capacity and t > 0 and t % rule.block == 0:
                    cache = choose_cache(fk[r, h], v[r, h], usable, cache, t, rule)
                held.append(cache)
            rows.append(held)
        history.append(rows)
    return history


def exact_keys(shape: tuple[int, int, int, int], real: torch.Tensor, causal: bool, rule: HybridRule,
               history: list[list[list]] | None) -> torch.Tensor:
    """``[B, Hq, N, M]`` (``shape`` = (B, Hq, N, M)): True where key j is in query i's softmax part, win(i) ∪
    sinks ∪ cache(i) (every key for an exact head without a cache); query i sits at position M - N + i."""
    b, hq, n, m = shape
    exact = torch.zeros(b, hq, n, m, dtype=torch.bool)
    sinks = sink_positions(real, rule.sinks)
    g = hq // len(history[0]) if history else 1
    for r in range(b):
        for qh in range(hq):
            for i in range(n):
                p = m - n + i
                for j in range(m):
                    near = (p - j < rule.window) if causal else (abs(p - j) < rule.window)
                    cached = history is not None and j in history[r][qh // g][p]
                    every = qh in rule.softmax_heads and not rule.capacity
                    exact[r, qh, i, j] = near or j in sinks[r] or cached or every
    return exact


def hybrid_reference(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_mask: torch.Tensor | None = None, causal: bool = True,
                     scaling: float | None = None) -> torch.Tensor:
    """The window hybrid of a feature-map ``kernel`` (its options: window, sinks, sparse cache, λ, exact heads)
    evaluated directly, in float64 and differentiable in q, k, v and the kernel's parameters (the cache choice is
    discrete): ``[B, N, Hq, Dv]``; ``q`` ``[B, Hq, N, D]``, ``k``/``v`` ``[B, Hkv, M, ·]``, ``key_mask`` ``[B, M]``."""
    rule = HybridRule.of(kernel.options)
    if rule.capacity and not causal:
        raise ValueError(f"{kernel.name}: sparse_cache is causal only (the cache holds pairs that left a causal "
                         "window)")
    b, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    real = torch.ones(b, m, dtype=torch.bool) if key_mask is None else key_mask.bool().cpu()
    history = None
    if rule.capacity:
        with torch.no_grad():
            history = cache_history(kernel.features(q, k, scaling)[1], v, real, rule)
    exact = exact_keys((b, hq, n, m), real, causal, rule, history).to(q.device)
    pos = torch.arange(m, device=q.device)
    vis = real.to(q.device)[:, None, None, :].expand(b, 1, n, m)
    if causal:
        vis = vis & (pos[None, :] <= pos[m - n:, None])
    kk, vv = k.to(f64).repeat_interleave(hq // hkv, 1), v.to(f64).repeat_interleave(hq // hkv, 1)
    logits = scaling * q.to(f64) @ kk.transpose(-1, -2)
    lam = torch.ones(hq, dtype=f64, device=q.device)
    if getattr(kernel, "window_log_mix", None) is not None:
        lam = kernel.window_log_mix.to(f64).exp()
    if rule.capacity and rule.softmax_heads:  # retrieval heads on a budget: no linear part
        lam = lam * torch.tensor([h not in rule.softmax_heads for h in range(hq)], dtype=f64, device=q.device)
    kappa = kernel.scores(q, k, scaling).to(f64) * lam[None, :, None, None]
    # one shift c_i (the largest visible exact logit, at least 0) on both parts cancels exactly
    shift = logits.masked_fill(~(vis & exact), float("-inf")).amax(-1, keepdim=True).clamp_min(0)
    weights = torch.where(exact, (logits - shift).exp(), kappa * (-shift).exp()) * vis
    den = weights.sum(-1, keepdim=True)
    den = torch.where(den > 0, den, torch.ones_like(den))
    return ((weights @ vv) / den).transpose(1, 2)
