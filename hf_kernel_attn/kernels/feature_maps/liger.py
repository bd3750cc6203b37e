"""Liger: gated linear attention with a gate from the layer's own keys (Lan et al., ICML 2025)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..base import number_in, option
from .gated import GatedKernel, GatedOptions, pair_norms, rope_halves, softmax_


@dataclasses.dataclass
class LigerOptions(GatedOptions):
    gate_bias: float = option(3.0, "α = σ(gate_bias + s^1/2 ρ): at least σ(3) ≈ 0.95, a memory of ≳ 20 tokens")

    def validate(self) -> None:
        super().validate()
        number_in("gate_bias", self.gate_bias, -50.0, 50.0, meaning="σ(±50) is 0 or 1 in float32 already")


class LigerKernel(GatedKernel):
    """Liger-style gated linear attention with no new weights (Lan et al., ICML 2025, "Liger: Linearizing Large
    Language Models to Gated Recurrent Structures"): φ(x) = [softmax(s^1/2 x), softmax(-s^1/2 x)] and a gate
    pooled from the layer's own keys, one per RoPE rotation pair i, log α_{t,i} = log σ(gate_bias + s^1/2 ρ_{t,i})
    with ρ the pair norms of k_t; coordinate j of either softmax reads the gate of its pair. Coordinates are taken
    in :func:`rope_halves` order (zero-padded to 2P for odd D), so pair i's features are i mod P and the gates tile
    the features. Conversion trains the model's own projections (LoRA) around it; use it with a window
    (``window=64``), as Liger does."""

    name = "liger"
    options_cls = LigerOptions
    paper = "Lan et al., ICML 2025, Liger: Linearizing LLMs to Gated Recurrent Structures"

    def num_features(self) -> int:
        return 4 * -(-self.shape.head_dim // 2)

    def feature(self, x, pos, scaling):
        h = rope_halves(x, self.options.rope_pairs)
        if torch.is_grad_enabled() and h.requires_grad:
            p = h * math.sqrt(scaling)
            features = torch.softmax(torch.stack([p, -p], -2), -1)  # [..., 2, D]
        else:  # the same numbers in one buffer (large fresh allocations are what costs on CPU)
            features = h.new_empty(*h.shape[:-1], 2, h.shape[-1])
            torch.mul(h, math.sqrt(scaling), out=features[..., 0, :])
            torch.mul(h, -math.sqrt(scaling), out=features[..., 1, :])
            softmax_(features)
        if x.shape[-1] % 2:  # the middle coordinate's partner is a zero feature
            features = torch.nn.functional.pad(features, (0, 1))
        return features.flatten(-2)

    def log_gate(self, k, scaling):
        rho = pair_norms(rope_halves(k, self.options.rope_pairs))
        if torch.is_grad_enabled() and rho.requires_grad:
            return nn.functional.logsigmoid(self.options.gate_bias + rho * math.sqrt(scaling))  # [B, H, M, P]
        return nn.functional.logsigmoid(rho.mul_(math.sqrt(scaling)).add_(self.options.gate_bias))
