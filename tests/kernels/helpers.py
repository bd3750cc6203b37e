"""Kernels, inputs and masks for the kernel tests (shared by the test modules of this folder)."""

from __future__ import annotations

import torch

from hf_kernel_attn.kernels import KERNELS, LayerShape, build_kernel

LINEAR = sorted(n for n, c in KERNELS.items() if c.is_linear)
D, DV = 8, 5
SCALING = 0.3  # deliberately not D^-1/2, so a kernel ignoring `scaling` is caught

# per-kernel params for the generic tests; skyformer: few landmarks (a real approximation, forced: at these
# lengths `form: auto` would run the exact Gaussian) and enough Newton–Schulz steps that the iterative
# inverse matches the reference's exact inverse
PARAMS = {"skyformer": {"num_landmarks": 8, "newton_iters": 30, "form": "nystrom"}}


def make_kernel(name, hq=4, hkv=2, params=None, layer_idx=0, max_positions=32, randomize=True, head_dim=D):
    p = dict(PARAMS.get(name, {}))
    p.update(params or {})
    kern = build_kernel(name, LayerShape(hq, hkv, head_dim, layer_idx, max_positions), p)
    if randomize:
        randomize_parameters(kern)
    return kern


def randomize_parameters(kern):
    """Move learnable parameters off their init, so per-head indexing is actually exercised."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        if kern.name == "gaussian" and not kern.options.augment:
            kern.log_gain.copy_(0.4 * torch.randn(kern.log_gain.shape, generator=gen))
        elif kern.name == "cosine":
            kern.log_gain.copy_(torch.log(1.0 + 4.0 * torch.rand(kern.log_gain.shape, generator=gen)))
        elif kern.name in ("hedgehog", "gla"):
            for w in (kern.weight_q, kern.weight_k):
                w.add_(0.5 * torch.randn(w.shape, generator=gen))
            for b in (kern.bias_q, kern.bias_k):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
        if kern.name == "gla":  # gates away from ~1, so the decay matters
            kern.gate_up.copy_(torch.randn(kern.gate_up.shape, generator=gen))
            kern.gate_bias.copy_(torch.randn(kern.gate_bias.shape, generator=gen))
    return kern


def make_inputs(b, hq, hkv, n, m, dtype=torch.float32, seed=0, head_dim=D):
    torch.manual_seed(seed)
    q = torch.randn(b, hq, n, head_dim)
    k = torch.randn(b, hkv, m, head_dim)
    v = torch.randn(b, hkv, m, DV)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_mask(b, m, causal, pad=3):
    """Left padding for causal (decoder) batches, right padding for bidirectional (encoder) ones;
    sequence 0 is unpadded, sequence 1 has ``pad`` pad tokens."""
    mask = torch.ones(b, m, dtype=torch.bool)
    if causal:
        mask[1, :pad] = False
    else:
        mask[1, m - pad:] = False
    return mask
