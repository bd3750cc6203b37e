"""Gaussian (RBF) attention: w_ij ∝ exp(-||q_i - k_j||² / (2σ²)).

Row normalisation cancels exp(-||q_i||²/(2σ²)), so the normalised kernel is softmax attention with
scale 1/σ² and a per-key bias -||k_j||²/(2σ²) (Tsai et al., EMNLP 2019, "Transformer Dissection";
Chen et al., NeurIPS 2021, "Skyformer"). The bias is folded into one extra coordinate,
q'' = [q, 1] / σ², k'' = [k, -||k||²/2], so the fused SDPA path needs no float mask.

σ is learnable per query head: 1/σ_h² = base · exp(log_gain_h) with base = the host's softmax scale
(σ² = 1/s, which leaves every q·k logit unchanged and only adds the key-norm penalty) or 1/sigma².
``projection`` adds a learnable identity-initialised per-head map on q and k (see ``projection.py``):
``diagonal`` is the ARD Gaussian exp(-Σ_d (a_d q_d - b_d k_d)²/(2σ²)).

``augment=True`` appends one coordinate per head, q' = [q, a], k' = [k, b_k] with a ≥ max_j ||k_j||
and b_k = ||k||² / (a + sqrt(a² - ||k||²)); the Gaussian on (q', k') with σ² = 1/s then equals
softmax(s q·k) exactly (see docs/kernels.md §1).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .base import Kernel, KernelOptions, expand_kv, number_in, one_of, option, visibility_mask
from .projection import PROJECTIONS, QKProjection
from .softmax import fused_attention


@dataclasses.dataclass
class GaussianOptions(KernelOptions):
    sigma: float | None = option(None, "bandwidth σ at init; None = σ² = 1 / (the host's softmax scale), which "
                                       "keeps every q·k logit and adds the key-norm penalty")
    learnable: bool = option(True, "train the per-head bandwidth (attention transfer); False keeps σ fixed")
    normalize: bool = option(True, "row-normalise the weights (softmax with a key-norm bias); False = the raw "
                                   "Σ_j κ(q_i, k_j) v_j")
    augment: bool = option(False, "append one coordinate to q and k so that the Gaussian equals softmax exactly "
                                  "at init (needs normalize)")
    projection: str = option("none", "learnable per-head map on q, k: none | diagonal (ARD bandwidths) | full")

    def validate(self) -> None:
        if self.sigma is not None:
            number_in("sigma", self.sigma, 1e-4, 1e4, meaning="or None for σ² = 1 / the softmax scale")
        one_of("projection", self.projection, PROJECTIONS)
        for flag in ("learnable", "normalize", "augment"):
            one_of(flag, getattr(self, flag), (True, False))
        if self.augment and not self.normalize:
            raise ValueError("augment=True needs normalize=True (the exact softmax identity is row-normalised)")


def augment_keys(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a = max ||k|| (per batch and KV head) to q and b_k to k; see the module docstring."""
    k_sq = k.float().pow(2).sum(-1, keepdim=True)  # [B, Hkv, M, 1]
    a = k_sq.amax(dim=-2, keepdim=True).sqrt()  # [B, Hkv, 1, 1]
    tiny = torch.finfo(torch.float32).tiny
    gap = a * a - k_sq  # >= 0; exactly 0 for the longest key, whose gap stays 0 when it moves: derivative 0
    root = torch.where(gap > 0, gap.clamp_min(tiny).sqrt(), torch.zeros_like(gap))  # sqrt'(0) = inf gave NaN dk
    b = k_sq / (a + root).clamp_min(tiny)
    g = q.shape[1] // k.shape[1]
    a_q = a.repeat_interleave(g, dim=1).expand(-1, -1, q.shape[-2], -1)
    return torch.cat([q.float(), a_q], -1), torch.cat([k.float(), b], -1)


class GaussianKernel(Kernel):
    """Row-normalised (or raw) RBF kernel attention with a learnable per-head bandwidth."""

    name = "gaussian"
    options_cls = GaussianOptions
    paper = "Tsai et al., EMNLP 2019 (Transformer Dissection); Chen et al., NeurIPS 2021 (Skyformer)"

    def __init__(self, shape, options):
        super().__init__(shape, options)
        self.log_gain = nn.Parameter(torch.zeros(shape.num_heads), requires_grad=options.learnable)
        self.projection = None
        if options.projection != "none":
            self.projection = QKProjection(options.projection, shape.num_heads, shape.num_kv_heads, shape.head_dim)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.log_gain.zero_()
        if self.projection is not None:
            self.projection.reset_parameters()

    def inv_sigma_sq(self, scaling: float | None, head_dim: int) -> torch.Tensor:
        if self.options.sigma is not None:
            base = 1.0 / self.options.sigma**2
        else:
            base = head_dim**-0.5 if scaling is None else scaling
        return base * self.log_gain.float().exp()  # [Hq]

    supports_bias = True

    def score_dim(self, head_dim: int) -> int:
        return head_dim + 1  # |q - k|² as one product of [q, 1] and [k, -|k|²/2]-style rows

    def log_scores(self, q, k, scaling):
        """log κ = -|q' - k'|² / (2σ²) (q', k' after the optional projection)."""
        if self.projection is not None:
            q, k = self.projection(q, k)
        inv = self.inv_sigma_sq(scaling, q.shape[-1]).to(q.dtype)[None, :, None, None]
        return -inv * torch.cdist(q, expand_kv(k, q.shape[1])).pow(2) / 2

    def forward(self, q, k, v, *, key_mask=None, causal=True, scaling=None, dropout=0.0, bias=None):
        self.check_inputs(q, k, v, causal)
        if q.shape[1] != self.log_gain.numel():
            raise ValueError(f"gaussian kernel was built for {self.log_gain.numel()} heads, got {q.shape[1]}")
        dtype = q.dtype
        head_dim = q.shape[-1]  # before augmentation adds a coordinate
        if self.projection is not None:
            q, k = self.projection(q.float(), k.float())
        if self.options.augment:
            q, k = augment_keys(q, k)
        inv = self.inv_sigma_sq(scaling, head_dim)[None, :, None, None]
        if not self.options.normalize:
            if bias is not None:
                raise ValueError("gaussian with normalize=False takes no additive position bias; use normalize=True")
            return unnormalized_gaussian(q, k, v, inv, key_mask=key_mask, causal=causal).to(dtype)
        return normalized_gaussian(q, k, v, inv, key_mask=key_mask, causal=causal, dropout=dropout,
                                   bias=bias).to(dtype)


def normalized_gaussian(q, k, v, inv: torch.Tensor | float, *, key_mask=None, causal=False,
                        dropout: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row-normalised exp(-inv ||q_i - k_j||²/2) attention as one fused SDPA call: softmax over
    q'' = [q, 1]·inv, k'' = [k, -||k||²/2] (``inv`` a float or ``[1, Hq, 1, 1]``); returns fp32
    ``[B, N, Hq, Dv]``."""
    # fp32 throughout: the key-norm bias is large, and a data-dependent shift to tame it in low
    # precision would let later keys perturb earlier rows' rounding
    kf = k.float()
    norm_term = -kf.pow(2).sum(-1, keepdim=True) / 2
    q2 = torch.cat([q.float(), torch.ones_like(q[..., :1], dtype=torch.float32)], -1) * inv
    k2 = torch.cat([kf, norm_term], -1)
    # torch's fused CPU kernels need equal q/k and v head dims: pad v with zeros, drop them after
    vf = v.float()
    pad = q2.shape[-1] - vf.shape[-1]
    if pad > 0:
        vf = torch.cat([vf, vf.new_zeros(*vf.shape[:-1], pad)], -1)
    out = fused_attention(q2, k2, vf, key_mask=key_mask, causal=causal, scale=1.0, dropout=dropout,
                          bias=None if bias is None else bias.float())
    return out[..., : v.shape[-1]]


def unnormalized_gaussian(q, k, v, inv: torch.Tensor | float, *, key_mask=None, causal=False) -> torch.Tensor:
    """Σ_j exp(-inv ||q_i - k_j||²/2) v_j, no row normalisation (Skyformer's 'kernelized' form); fp32
    ``[B, N, Hq, Dv]``."""
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, 1) if g > 1 else k.float()
    vf = v.float().repeat_interleave(g, 1) if g > 1 else v.float()
    dist = torch.cdist(q.float(), kf).pow(2)
    w = torch.exp(-dist * inv / 2)
    mask = visibility_mask(key_mask, q.shape[-2], k.shape[-2], causal, q.device)
    if mask is not None:
        w = w * mask
    return (w @ vf).transpose(1, 2).contiguous()

