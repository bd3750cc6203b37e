"""Cosine-normalised attention (QKNorm; Henry et al., Findings of EMNLP 2020).

w_ij = softmax_j(g_h · q̂_i·k̂_j) with q̂ = q/||q||, k̂ = k/||k|| and a learnable per-head gain g_h
(stored as log g). Logits are bounded in [-g, g]. Init: ``gain`` if given, else g0 = log2(L² - L)
with L = ``length``; attention transfer (``hf-kernel-attn finetune``) trains g_h, and with
``projection`` a learnable per-head map on q and k before normalising (``projection.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .base import EPS_RANGE, MAX_TOKENS, Kernel, KernelOptions, accum, expand_kv, integer_in, number_in, one_of, option
from .projection import PROJECTIONS, QKProjection
from .softmax import fused_attention


@dataclasses.dataclass
class CosineOptions(KernelOptions):
    gain: float | None = option(None, "per-head gain g at init (logits lie in [-g, g]); None = log2(L² - L) "
                                      "with L = length")
    length: int = option(512, "L of the default gain init log2(L² - L) (QKNorm)")
    learnable: bool = option(True, "train the per-head gain (attention transfer); False keeps it fixed")
    eps: float = option(1e-6, "floor of ||q|| and ||k|| when normalising")
    projection: str = option("none", "learnable per-head map on q, k before normalising: none | diagonal | full")

    def validate(self) -> None:
        if self.gain is not None:
            number_in("gain", self.gain, 0.0, 1e4, low_open=True, meaning="or None for log2(L² - L)")
        number_in("eps", self.eps, *EPS_RANGE, meaning="a floor far below the norms")
        integer_in("length", self.length, 2, MAX_TOKENS)
        one_of("learnable", self.learnable, (True, False))
        one_of("projection", self.projection, PROJECTIONS)


def default_gain(length: int) -> float:
    """QKNorm's gain init g0 = log2(L² - L)."""
    return math.log2(length * length - length)


class CosineKernel(Kernel):
    name = "cosine"
    options_cls = CosineOptions
    paper = "Henry et al., Findings of EMNLP 2020, Query-Key Normalization for Transformers"

    def __init__(self, shape, options):
        super().__init__(shape, options)
        self.log_gain = nn.Parameter(torch.empty(shape.num_heads), requires_grad=options.learnable)
        self.projection = None
        if options.projection != "none":
            self.projection = QKProjection(options.projection, shape.num_heads, shape.num_kv_heads, shape.head_dim)

    def reset_parameters(self) -> None:
        if self.projection is not None:
            self.projection.reset_parameters()
        g0 = self.options.gain if self.options.gain is not None else default_gain(self.options.length)
        with torch.no_grad():
            self.log_gain.fill_(math.log(g0))

    supports_bias = True

    def log_scores(self, q, k, scaling):
        """log κ = g_h cos(q', k') (q', k' after the optional projection)."""
        if self.projection is not None:
            q, k = self.projection(q, k)
        k = expand_kv(k, q.shape[1])
        gain = self.log_gain.to(q.dtype).exp()[None, :, None, None]
        qn = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        kn = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return gain * qn @ kn.transpose(-1, -2)

    def forward(self, q, k, v, *, key_mask=None, causal=True, scaling=None, dropout=0.0, bias=None):
        self.check_inputs(q, k, v, causal)
        if q.shape[1] != self.log_gain.numel():
            raise ValueError(f"cosine kernel was built for {self.log_gain.numel()} heads, got {q.shape[1]}")
        dtype = q.dtype
        eps = self.options.eps
        if self.projection is not None:
            q, k = self.projection(accum(q), accum(k))
        q, k = accum(q), accum(k)
        qn = q / q.norm(dim=-1, keepdim=True).clamp_min(eps)
        kn = k / k.norm(dim=-1, keepdim=True).clamp_min(eps)
        qn = qn * self.log_gain.to(q.dtype).exp()[None, :, None, None]
        # fp32 scores: the gain (≈ log2 L², ~20) turns a half-precision rounding of the unit vectors into
        # logit errors of ~0.1
        return fused_attention(qn, kn, accum(v), key_mask=key_mask, causal=causal, scale=1.0,
                               dropout=dropout, bias=None if bias is None else accum(bias)).to(dtype)
