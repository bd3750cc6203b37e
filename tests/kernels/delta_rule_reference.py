"""The float64 brute force of DeltaNet and Gated DeltaNet (kernels ``deltanet``, ``gated_deltanet``), for
tests/kernels/test_delta_rule.py and reference.py.

It is a plain Python loop over batch rows, query heads and tokens, written from the papers'
formula in their own layout (S ``[Dv, D]``, o_t = S_t q̂_t; Schlag et al. 2021, Yang et al. 2025):

    S_t = α_t S_{t-1} (I - β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ

It never calls the package's feature maps, gates, or delta-rule forms: β_t and α_t are recomputed here from the
kernel's parameters (read, not detached, so autograd through the brute force gives their gradients too).
"""

from __future__ import annotations

import math

import torch

f64 = torch.float64


def _phi(x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
    if name == "silu":
        x = x * torch.sigmoid(x)
    elif name == "elu":
        x = torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0.0)))
    return x / torch.clamp(torch.sqrt((x * x).sum()), min=eps)


def _features(kern, x: torch.Tensor, head: int, query: bool, scaling: float) -> torch.Tensor:
    """q̂ or k̂ of one vector ``[D]`` of query head / KV head ``head``."""
    opts = kern.options
    if opts.feature_map != "hedgehog":
        return _phi(x, opts.feature_map, opts.eps)
    w, b = (kern.weight_q, kern.bias_q) if query else (kern.weight_k, kern.bias_k)
    p = math.sqrt(scaling) * (x @ w[head].to(f64)) + b[head].to(f64)
    both = torch.cat([torch.exp(p - p.max()) / torch.exp(p - p.max()).sum(),
                      torch.exp(-p - (-p).max()) / torch.exp(-p - (-p).max()).sum()])
    return both / torch.clamp(torch.sqrt((both * both).sum()), min=opts.eps)


def _pair_norms(x: torch.Tensor) -> torch.Tensor:
    """Norms of the RoPE rotation pairs (i, i + ⌈D/2⌉) of one vector ``[D]`` (the odd middle coordinate alone)."""
    d = x.shape[-1]
    half = -(-d // 2)
    out = []
    for i in range(half):
        partner = x[i + half] if i + half < d else x.new_zeros(())
        out.append(torch.sqrt(torch.clamp(x[i] ** 2 + partner ** 2, min=1e-12)))
    return torch.stack(out)


def _beta(kern, kt: torch.Tensor, h: int, scaling: float) -> torch.Tensor:
    if kern.options.beta is not None:
        return torch.tensor(float(kern.options.beta), dtype=f64)
    rho = _pair_norms(kt)
    logit = math.sqrt(scaling) * (rho * kern.beta_weight[h].to(f64)).sum() + kern.beta_bias[h].to(f64)
    return 1.0 / (1.0 + torch.exp(-logit))


def _alpha(kern, kt: torch.Tensor, h: int, scaling: float) -> torch.Tensor:
    if kern.name != "gated_deltanet":
        return torch.tensor(1.0, dtype=f64)
    rho = _pair_norms(kt) * math.sqrt(scaling)
    logit = (rho @ kern.gate_down[h].to(f64) @ kern.gate_up[h].to(f64))[0] + kern.gate_bias[h, 0].to(f64)
    log_alpha = -torch.log1p(torch.exp(-logit)) / kern.options.gate_temperature
    return torch.exp(torch.clamp(log_alpha, min=-1.25))  # the gated kernels' floor on ln α


def brute_force(kern, q, k, v, key_mask=None, scaling=None):
    """``[B, N, Hq, Dv]`` float64 from raw q ``[B, Hq, N, D]``, k/v ``[B, Hkv, M, ·]`` (bottom-right causal, key
    padding; the window / sinks / window_mix hybrid when the kernel's options say so)."""
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    b, hq, n, d = q.shape
    hkv, m, dv = k.shape[1], k.shape[2], v.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    opts = kern.options
    window, sinks = opts.window, opts.sinks
    mix = getattr(kern, "memory_mix", None)
    rows = []
    for bi in range(b):
        real = [True] * m if key_mask is None else [bool(x) for x in key_mask[bi]]
        sink = [False] * m
        seen = 0
        for j in range(m):
            if real[j] and seen < sinks:
                sink[j] = True
            seen += real[j]
        heads = []
        for h in range(hq):
            g = h // (hq // hkv)
            memory = torch.zeros(dv, kern.num_features(), dtype=f64)
            after, log_decay = [], [torch.tensor(0.0, dtype=f64)]  # memory after key j; Σ ln α up to j
            for j in range(m):
                if real[j] and not sink[j]:
                    kh = _features(kern, k[bi, g, j], g, False, scaling)
                    alpha = _alpha(kern, k[bi, g, j], g, scaling)
                    beta = _beta(kern, k[bi, g, j], g, scaling)
                    memory = alpha * memory @ (torch.eye(kh.shape[0], dtype=f64) - beta * torch.outer(kh, kh)) \
                        + beta * torch.outer(v[bi, g, j], kh)
                    log_decay.append(log_decay[-1] + torch.log(alpha))
                else:
                    log_decay.append(log_decay[-1])
                after.append(memory)
            outs = []
            for i in range(n):
                p = m - n + i
                qh = _features(kern, q[bi, h, i], h, True, scaling)
                if not window:
                    outs.append(after[p] @ qh)
                    continue
                keys = [j for j in range(p + 1) if real[j] and (p - j < window or sink[j])]
                if keys:
                    logits = torch.stack([scaling * (q[bi, h, i] * k[bi, g, j]).sum() for j in keys])
                    weights = torch.softmax(logits, 0)
                    o = sum(w * v[bi, g, j] for w, j in zip(weights, keys, strict=True))
                else:
                    o = torch.zeros(dv, dtype=f64)
                t = p - window
                if t >= 0:
                    far = torch.exp(log_decay[p + 1] - log_decay[t + 1]) * (after[t] @ qh)
                    o = o + (1.0 if mix is None else mix[h].to(f64)) * far
                outs.append(o)
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads, 1))
    return torch.stack(rows)


