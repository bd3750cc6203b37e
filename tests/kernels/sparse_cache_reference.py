"""The float64 brute force of the window hybrid's bounded sparse cache (option ``sparse_cache``) and the small
kernels, inputs and model its tests share (tests/kernels/test_sparse_cache.py, test_window_decode.py).

The brute force is a Python loop over batch rows, KV heads and query positions that keeps the cache as a *set* of
positions and recomputes, at every boundary, the state of the other out-of-window keys from scratch (no running
state, no subtraction), then weighs every visible key of every query by the rule of the module docstring of
``hf_kernel_attn.kernels.linear.sparse_cache``. It shares only φ with the code under test (the feature maps have
their own tests). With ``sparse_cache=0`` it is the plain window hybrid.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kernel_attn.kernels import LayerShape, build_kernel

D, DV = 8, 6
SCALING = 0.35
f64 = torch.float64


def make(name="hedgehog", hq=4, hkv=2, *, window=5, sinks=0, capacity=3, block=4, mix=True, dtype=f64, heads=()):
    params = dict(window=window, sparse_cache=capacity, sparse_block=block, chunk_size=8, softmax_heads=list(heads))
    if sinks:
        params["sinks"] = sinks
    if mix:
        params["window_mix"] = True
    kern = build_kernel(name, LayerShape(hq, hkv, D, 0, 4096), params).to(dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if mix:
            kern.window_log_mix.copy_(torch.randn(hq, generator=gen))
        for p in ("weight_q", "weight_k"):
            if hasattr(kern, p):
                getattr(kern, p).add_(0.5 * torch.randn(getattr(kern, p).shape, generator=gen))
    return kern


def inputs(b, hq, hkv, n, seed=0, dtype=f64, dv=DV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, D, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, n, D, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=dtype)
    return q, k, v


def brute_force(kern, q, k, v, key_mask=None):
    """Outputs ``[B, N, Hq, Dv]`` and the final cache (per row and KV head, the set of cached positions)."""
    o = kern.options
    window, capacity, block, nsinks, eps = o.window, o.sparse_cache, o.sparse_block, o.sinks, o.eps
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    fq, fk = kern.features(q, k, SCALING)  # [B, Hkv, G, N, F], [B, Hkv, N, F]
    fq, fk, q, k, v = fq.to(f64), fk.to(f64), q.to(f64), k.to(f64), v.to(f64)
    lam = torch.ones(hq, dtype=f64) if not hasattr(kern, "window_log_mix") else kern.window_log_mix.detach().exp()
    lam[o.softmax_heads] = 0.0  # retrieval heads on a budget: the window, sinks and cache alone
    real = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask.bool()
    dv = v.shape[-1]
    out = torch.zeros(b, n, hq, dv, dtype=f64)
    caches = {}
    for r in range(b):
        reals = [j for j in range(n) if real[r, j]]
        sinks = set(reals[:nsinks])
        for h in range(hkv):
            cache: set[int] = set()
            for i in range(n):
                if i > 0 and i % block == 0:
                    cands = {j for j in range(max(0, i - block - window + 1), i - window + 1)
                             if real[r, j] and j not in sinks}
                    pool = cache | cands
                    others = [j for j in range(0, i - window + 1) if real[r, j] and j not in sinks and j not in pool]
                    s_mat = torch.zeros(fk.shape[-1], dv, dtype=f64)
                    z = torch.zeros(fk.shape[-1], dtype=f64)
                    for j in others:
                        s_mat += torch.outer(fk[r, h, j], v[r, h, j])
                        z += fk[r, h, j]
                    z_full = z + sum((fk[r, h, j] for j in cands), torch.zeros_like(z))
                    scores = {}
                    for j in pool:  # the documented floor: ρ = 1e-3 of the mass with the candidates
                        den = max(float(fk[r, h, j] @ z), 1e-3 * float(fk[r, h, j] @ z_full), eps)
                        read = (fk[r, h, j] @ s_mat) / den
                        scores[j] = float((v[r, h, j] - read).square().sum())
                    cache = set(sorted(pool, key=lambda j: -scores[j])[:capacity])
                for gi in range(g):
                    qh = h * g + gi
                    num = torch.zeros(dv, dtype=f64)
                    den = 0.0
                    for j in range(i + 1):
                        if not real[r, j]:
                            continue
                        if i - j < window or j in sinks or j in cache:
                            w = torch.exp(SCALING * q[r, qh, i] @ k[r, h, j])
                        else:
                            w = lam[qh] * (fq[r, h, gi, i] @ fk[r, h, j])
                        w = w.detach()
                        num += w * v[r, h, j]
                        den += float(w)
                    out[r, i, qh] = num / den
            caches[r, h] = cache
    return out, caches


def tiny_lm():
    """A 2-layer random Llama (4 query / 2 KV heads), peaked attention, in eval mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
    return model


def cached_positions(state, r, h):
    sc = state.sparse
    return {int(p) for p, ok in zip(sc.pos[r, h], sc.valid[r, h], strict=True) if ok}


def padding(b, n, pad):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :pad] = False  # left padding on the second row
    return mask
