"""Softmax attention: the exponential kernel exp(s <q, k>) normalised over the context.

This is the reference every other kernel is compared to (Vaswani et al., 2017); it runs through
torch's fused ``scaled_dot_product_attention`` (SDPA) without repeating K/V for GQA.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .base import Kernel, KernelOptions, visibility_mask


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(scale * q kᵀ + mask) v through SDPA; returns ``[B, N, Hq, Dv]``."""
    n, m = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if key_mask is None and (not causal or n == m or n == 1):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and n == m and n > 1, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
    else:
        mask = visibility_mask(key_mask, n, m, causal, q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous()


@dataclasses.dataclass
class SoftmaxOptions(KernelOptions):
    pass


class SoftmaxKernel(Kernel):
    """softmax(s q kᵀ) v — the pretrained model's own attention."""

    name = "softmax"
    options_cls = SoftmaxOptions
    paper = "Vaswani et al., 2017, Attention Is All You Need"

    def forward(self, q, k, v, *, key_mask=None, causal=True, scaling=None, dropout=0.0):
        self.check_inputs(q, k, v, causal)
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        return fused_attention(q, k, v, key_mask=key_mask, causal=causal, scale=scale, dropout=dropout)
