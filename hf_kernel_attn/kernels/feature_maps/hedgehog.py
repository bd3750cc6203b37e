"""Hedgehog: a learnable per-head map φ(x) = [softmax(s^1/2 x W + b), softmax(-(s^1/2 x W + b))] (Zhang et al.,
ICLR 2024)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..base import MAX_FEATURES, LayerShape, accum, integer_in, option
from .base import LinearKernel, LinearOptions


@dataclasses.dataclass
class HedgehogOptions(LinearOptions):
    feature_dim: int | None = option(None, "features per sign (the map has twice as many); None = head_dim "
                                           "(identity init)", bound="features")
    eps: float = option(1e-12, "floor of the normaliser φ(q_i)·Σ_j φ(k_j)")

    def validate(self) -> None:
        super().validate()
        if self.feature_dim is not None:
            integer_in("feature_dim", self.feature_dim, 1, MAX_FEATURES, meaning="or None for head_dim")


class HedgehogKernel(LinearKernel):
    """Learnable per-head map φ(x) = [softmax(s^1/2 x W + b), softmax(-(s^1/2 x W + b))], one map for
    queries (per query head) and one for keys (per KV head) (Zhang et al., ICLR 2024, Hedgehog;
    the two-softmax form of LoLCATs). W starts as the identity (truncated or zero-padded when the
    feature dim differs from the head dim) and b at 0; attention transfer trains them."""

    name = "hedgehog"
    options_cls = HedgehogOptions
    paper = "Zhang et al., ICLR 2024, The Hedgehog & the Porcupine"

    def __init__(self, shape: LayerShape, options: HedgehogOptions):
        super().__init__(shape, options)
        d = shape.head_dim
        f = options.feature_dim or d
        self.weight_q = nn.Parameter(torch.empty(shape.num_heads, d, f))
        self.bias_q = nn.Parameter(torch.empty(shape.num_heads, f))
        self.weight_k = nn.Parameter(torch.empty(shape.num_kv_heads, d, f))
        self.bias_k = nn.Parameter(torch.empty(shape.num_kv_heads, f))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            for w in (self.weight_q, self.weight_k):
                w.zero_()
                w += torch.eye(w.shape[1], w.shape[2])
            self.bias_q.zero_()
            self.bias_k.zero_()

    def num_features(self) -> int:
        return 2 * int(self.weight_q.shape[-1])

    def projection_width(self, backward: bool = False) -> int:
        """p = xW; with autograd, p and -p come from one matmul with [W, -W]."""
        return int(self.weight_q.shape[-1]) * (2 if backward else 1)

    @staticmethod
    def _map(x, w, b, scaling):
        """p = s^1/2 x W + b, then a softmax over each half of [p, -p] (one matmul for p; the same numbers with and
        without autograd)."""
        w, b = accum(w), accum(b)
        f = w.shape[-1]
        half = x @ (w * math.sqrt(scaling)) + b[..., None, :]
        p = torch.cat([half, -half], -1)
        return torch.softmax(p.view(*p.shape[:-1], 2, f), -1).view(p.shape)

    def feature_q(self, q, pos, scaling):
        hkv, g = q.shape[1], q.shape[2]
        w = self.weight_q.view(hkv, g, *self.weight_q.shape[1:])
        b = self.bias_q.view(hkv, g, -1)
        return self._map(q, w, b, scaling)

    def feature_k(self, k, pos, scaling):
        return self._map(k, self.weight_k, self.bias_k, scaling)
