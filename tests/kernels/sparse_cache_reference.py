"""The float64 brute force of the window hybrid's bounded sparse cache (option ``sparse_cache``) with sinks, and
the small kernels, inputs and model its tests share (tests/kernels/test_sparse_cache.py, test_window_decode.py,
test_cache_sizing.py, test_custom_kernel_example.py).

The brute force is the package's (``hf_kernel_attn.testing.sparse_reference``, which ``check_kernel`` uses too): a
Python loop over batch rows and KV heads that keeps the cache as a *set* of positions and recomputes, at every
boundary, the state of the other out-of-window keys from scratch (no running state, no subtraction), then weighs
every visible key of every query by the rule of the module docstring of ``hf_kernel_attn.kernels.linear.sparse_cache``.
It shares only φ and κ with the code under test (the feature maps have their own tests). With ``sparse_cache=0``
it is the plain window hybrid.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kernel_attn.kernels import LayerShape, build_kernel
from hf_kernel_attn.testing.sparse_reference import HybridRule, cache_history, hybrid_reference

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
    """Outputs ``[B, N, Hq, Dv]`` (float64) and the final cache (per row and KV head, the set of cached positions):
    the package's reference (:func:`hf_kernel_attn.testing.sparse_reference.hybrid_reference`) at ``SCALING``."""
    rule = HybridRule.of(kern.options)
    real = torch.ones(q.shape[0], k.shape[2], dtype=torch.bool) if key_mask is None else key_mask.bool()
    with torch.no_grad():
        out = hybrid_reference(kern, q, k, v, key_mask, causal=True, scaling=SCALING)
        history = cache_history(kern.features(q, k, SCALING)[1], v, real, rule) if rule.capacity else None
    caches = {(r, h): set(history[r][h][-1]) if history else set()
              for r in range(q.shape[0]) for h in range(k.shape[1])}
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
