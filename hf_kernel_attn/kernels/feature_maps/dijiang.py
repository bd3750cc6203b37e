"""DiJiang: φ(x) = softmax_f((s^1/2 x Cᵀ) ⊙ w) with C the DCT-II, scores decaying as γ_h^(i-j) (Chen et al.,
ICML 2024)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..base import LayerShape, accum, integer_in, one_of, option
from ..linear.gated import MAX_CHUNK_LOG_RANGE
from .base import MAX_SEED, LinearKernel, LinearOptions, layer_generator

# the fastest decay, γ = 1 - 1/32: C/2 · |ln γ| ≤ MAX_CHUNK_LOG_RANGE / 2 keeps e^{±·} finite in fp32
MAX_DECAY_CHUNK = int(MAX_CHUNK_LOG_RANGE / -math.log(1 - 1 / 32))


@dataclasses.dataclass
class DijiangOptions(LinearOptions):
    seed: int = option(0, "seed of the fixed per-layer frequency weights w (drawn with the layer index)")
    decay: bool = option(True, "scores decay as γ_h^(i-j), one fixed γ per KV head; False = no decay")

    def validate(self) -> None:
        super().validate()
        one_of("decay", self.decay, (True, False))
        integer_in("seed", self.seed, 0, MAX_SEED)
        if self.decay and self.chunk_size > MAX_DECAY_CHUNK:
            raise ValueError(f"chunk_size={self.chunk_size}: dijiang with decay=True needs chunk_size <= "
                             f"{MAX_DECAY_CHUNK} (the gated scan's in-chunk factors γ^(±C/2) stay finite in fp32)")


def dct_matrix(d: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix C[f, n] = α_f cos(π (n + 1/2) f / d)."""
    n = torch.arange(d, dtype=torch.float64)
    c = torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / d) * math.sqrt(2 / d)
    c[0] /= math.sqrt(2)
    return c.float()


class DijiangKernel(LinearKernel):
    """DiJiang frequency-domain kernel: φ(x) = softmax_f((s^1/2 x Cᵀ) ⊙ w) with C the DCT-II and
    w = Φ⁻¹(u), u ~ U(0,1) fixed per layer; scores decay as γ_h^(i-j) with
    γ_h = 1 - exp(linspace(ln 1/32, ln 1/512, Hkv)) (Chen et al., ICML 2024, DiJiang).
    Kept normalised (Σ γ^(i-j) φq·φk v / Σ γ^(i-j) φq·φk) so it is a drop-in for softmax; the decay is
    per KV head so that grouped query heads share one state, and runs as the constant gate log γ_h of the gated
    engine. Bidirectional use weighs γ^|i-j|."""
    supports_sparse_cache: ClassVar[bool] = False  # a decayed state cannot give a pair back exactly

    name = "dijiang"
    options_cls = DijiangOptions
    paper = "Chen et al., ICML 2024, DiJiang: Efficient LLMs through Compact Kernelization"

    def __init__(self, shape: LayerShape, options: DijiangOptions):
        super().__init__(shape, options)
        d = shape.head_dim
        self.register_buffer("projection", torch.empty(d, d))
        h = shape.num_kv_heads
        gammas = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h, dtype=torch.float64))
        self.gammas = gammas.tolist()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        d = self.projection.shape[0]
        gen = layer_generator(self.options.seed, self.shape.layer_idx)
        u = torch.rand(d, generator=gen, dtype=torch.float64)
        w = torch.distributions.Normal(0.0, 1.0).icdf(u)
        w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        with torch.no_grad():
            self.projection.copy_(dct_matrix(d).T * w.float()[None, :])

    def feature(self, x, pos, scaling):
        return torch.softmax((x * math.sqrt(scaling)) @ accum(self.projection), dim=-1)

    def projection_width(self, backward: bool = False) -> int:
        return int(self.projection.shape[-1])

    @property
    def log_gamma(self) -> torch.Tensor:
        """ln γ per KV head ``[Hkv]`` in fp64 (fixed, derived from the head count); the linear forms cast it
        to their accumulation dtype."""
        return torch.tensor(self.gammas, dtype=torch.float64, device=self.projection.device).log()

    def log_decay(self):
        return self.log_gamma if self.options.decay else None
