"""A kernel of your own for long decoding (docs/custom_kernels.md): signed-softplus features whose defaults are
the sliding-window hybrid with attention sinks and a bounded sparse cache.

Written against the public contract alone: ``FeatureMapKernel.feature_map``, ``reset_parameters`` and an options
dataclass subclassing ``LinearOptions``. ``check_kernel("signed_softplus")`` checks these defaults as they are and
at its own size (window 5, 2 sinks, 3 cached pairs chosen every 4 positions) against its float64 brute force.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

import hf_kernel_attn
from hf_kernel_attn.kernels.base import option


@dataclasses.dataclass
class WindowedOptions(hf_kernel_attn.LinearOptions):
    """``LinearOptions`` with other defaults: softmax over the last 64 keys and the first 4 real tokens, 16 pairs
    per KV head in the sparse cache, φ over every other key."""

    window: int = option(64, "W: exact softmax over the last W keys, φ over older ones", bound="tokens")
    sinks: int = option(4, "S: the first S real tokens join the softmax part", bound="tokens")
    sparse_cache: int = option(16, "C: per KV head, the C older pairs the state reproduces worst, attended exactly "
                                   "(causal only: 0 for an encoder)", bound="tokens")


@hf_kernel_attn.register_kernel
class SignedSoftplus(hf_kernel_attn.FeatureMapKernel):
    """φ(x) = [softplus(a ⊙ x + b), softplus(-a ⊙ x + b)] ∈ R^2D, applied to s^½ q and s^½ k (s the softmax
    scale), with a learnable per-dimension scale a (starts at 1) and shift b (starts at 0)."""

    name = "signed_softplus"
    options_cls = WindowedOptions
    scale_inputs = True

    def __init__(self, shape: hf_kernel_attn.LayerShape, options: WindowedOptions) -> None:
        super().__init__(shape, options)
        self.scale = nn.Parameter(torch.ones(shape.head_dim))
        self.shift = nn.Parameter(torch.zeros(shape.head_dim))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.ones_(self.scale)
        nn.init.zeros_(self.shift)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        z = x * self.scale
        return torch.cat([F.softplus(z + self.shift), F.softplus(self.shift - z)], -1)
