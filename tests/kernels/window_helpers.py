"""Windowed kernels, inputs and comparisons for the window-hybrid tests (test_window, test_window_sinks,
test_softmax_heads)."""

from __future__ import annotations

import torch

from hf_kernel_attn.kernels import LayerShape, build_kernel
from tests.kernels import reference as ref
from tests.kernels.helpers import make_mask

D, DV = 8, 5
SCALING = 0.3


def make(name, window_size, hq=4, hkv=2, mix=True, chunk_size=16, dtype=torch.float64, **params):
    """A windowed kernel with its learnable parameters (and λ_h) moved off their init."""
    params = {"window": window_size, "chunk_size": chunk_size, **params}
    if mix and window_size:
        params["window_mix"] = True
    kern = build_kernel(name, LayerShape(hq, hkv, D, 1, 4096), params).to(dtype)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        if hasattr(kern, "window_log_mix"):
            kern.window_log_mix.copy_(torch.randn(kern.window_log_mix.shape, generator=gen))
        if hasattr(kern, "memory_mix"):  # the delta kernels' λ_h, linear and starting at 0
            kern.memory_mix.copy_(torch.rand(kern.memory_mix.shape, generator=gen) + 0.5)
        if name in ("hedgehog", "gla"):
            for w in (kern.weight_q, kern.weight_k):
                w.add_(0.5 * torch.randn(w.shape, generator=gen))
        if name == "gla":  # gates away from ~1, so that their decay matters
            kern.gate_up.copy_(torch.randn(kern.gate_up.shape, generator=gen))
            kern.gate_bias.fill_(-1.0)
    return kern


def inputs(b, hq, hkv, n, m, dtype=torch.float64, seed=0, dv=DV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, D, generator=gen)
    k = torch.randn(b, hkv, m, D, generator=gen)
    v = torch.randn(b, hkv, m, dv, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padding(b, m, causal):
    return make_mask(b, m, causal, pad=5)


def compare(kern, q, k, v, key_mask, causal, tol):
    out = kern(q, k, v, key_mask=key_mask, causal=causal, scaling=SCALING)
    want = ref.reference(kern, q, k, v, key_mask=key_mask, causal=causal, scaling=SCALING)
    rows = ref.real_queries(q.shape[0], q.shape[-2], k.shape[-2], causal, key_mask)
    assert torch.isfinite(out).all()
    err = (out.to(torch.float64) - want).abs()[rows].max().item()
    assert err <= tol * max(1.0, want.abs()[rows].max().item()), err


def assert_gradients_match(kern, n, causal=True, seed=2):
    """Gradients w.r.t. q, k, v and the kernel's parameters equal those of the float64 brute force (GQA 4/2,
    key padding, the real query rows weighted)."""
    q, k, v = (t.requires_grad_() for t in inputs(2, 4, 2, n, n, seed=seed))
    mask = padding(2, n, causal)
    rows = ref.real_queries(2, n, n, causal, mask)
    gout = torch.randn(2, n, 4, DV, dtype=torch.float64) * rows[:, :, None, None]
    params = [p for p in kern.parameters() if p.requires_grad]
    got = torch.autograd.grad((kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING) * gout).sum(),
                              [q, k, v, *params])
    want = torch.autograd.grad((ref.reference(kern, q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
                                * gout).sum(), [q, k, v, *params])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
