"""GLA: hedgehog's maps with a learnable low-rank gate (Yang et al., ICML 2024)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..base import LayerShape, accum, option
from ..linear.gated import GATED_CHUNK
from .gated import GatedKernel, GatedOptions, check_low_rank_gate, low_rank_log_gate, reset_low_rank_gate, softmax_
from .hedgehog import HedgehogKernel, HedgehogOptions


@dataclasses.dataclass
class GlaOptions(HedgehogOptions, GatedOptions):
    gate_rank: int = option(16, "rank r of the learnable low-rank gate projection W₁W₂")
    gate_temperature: float = option(16.0, "τ: log α = log σ(·) / τ (GLA's normaliser)")
    chunk_size: int = option(GATED_CHUNK, "positions per chunk of the gated scan (at most 64: the in-chunk "
                                          "decay factors stay finite in fp32)")

    def validate(self) -> None:
        super().validate()
        check_low_rank_gate(self.gate_rank, self.gate_temperature)


class GlaKernel(GatedKernel, HedgehogKernel):
    """GLA-style gated linear attention (Yang et al., ICML 2024): hedgehog's learnable feature maps and a
    learnable low-rank gate per KV head, log α_t = log σ(s^1/2 ρ_t W₁ W₂ + β) / τ with ρ_t the RoPE-pair norms of
    k_t (W₁ ``[Hkv, ⌈D/2⌉, r]``, W₂ ``[Hkv, r, F]``, β ``[Hkv, F]``); W₂ starts at 0 and β at 4, so every gate
    starts at α = σ(4)^(1/τ) ≈ 0.999 and attention transfer learns them."""

    name = "gla"
    options_cls = GlaOptions
    paper = "Yang et al., ICML 2024, Gated Linear Attention Transformers with Hardware-Efficient Training"

    def __init__(self, shape: LayerShape, options: GlaOptions):
        super().__init__(shape, options)
        pairs, r, f = -(-shape.head_dim // 2), options.gate_rank, self.num_features()
        self.gate_down = nn.Parameter(torch.empty(shape.num_kv_heads, pairs, r))
        self.gate_up = nn.Parameter(torch.empty(shape.num_kv_heads, r, f))
        self.gate_bias = nn.Parameter(torch.empty(shape.num_kv_heads, f))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        reset_low_rank_gate(self.gate_down, self.gate_up, self.gate_bias, self.shape.layer_idx)

    @staticmethod
    def _map(x, w, b, scaling):
        """Hedgehog's map; without autograd in one buffer and in place (bit for bit the same numbers)."""
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return HedgehogKernel._map(x, w, b, scaling)
        w, b = accum(w), accum(b)
        half = (x @ (w * math.sqrt(scaling))).add_(b[..., None, :])
        out = half.new_empty(*half.shape[:-1], 2, half.shape[-1])
        out[..., 0, :].copy_(half)
        torch.neg(half, out=out[..., 1, :])
        return softmax_(out).flatten(-2)

    def gate_flops(self, n: int) -> float:
        """ρ W₁ W₂ per KV head: 2·n·(⌈D/2⌉·r + r·F)."""
        heads, pairs, r = self.gate_down.shape
        return 2.0 * n * heads * (pairs * r + r * self.gate_up.shape[-1])

    def log_gate(self, k, scaling):
        return low_rank_log_gate(k, scaling, self.options.rope_pairs, self.gate_down, self.gate_up, self.gate_bias,
                                 self.options.gate_temperature)
