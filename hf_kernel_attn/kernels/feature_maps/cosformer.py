"""cosFormer: φ(x_i) = [ReLU(x_i) sin θ_i, ReLU(x_i) cos θ_i], θ_i = (π/2) i / M (Qin et al., ICLR 2022)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..base import MAX_TOKENS, integer_in, option
from .base import LinearKernel, LinearOptions


@dataclasses.dataclass
class CosformerOptions(LinearOptions):
    horizon: int | None = option(None, "M of the re-weighting cos(π/2 (i - j)/M); None = the model's "
                                         "max_position_embeddings (keep contexts below M)")

    def validate(self) -> None:
        super().validate()
        if self.horizon is not None:
            integer_in("horizon", self.horizon, 1, MAX_TOKENS, meaning="or None for max_position_embeddings")


class CosformerKernel(LinearKernel):
    """φ(x_i) = [ReLU(x_i) sin θ_i, ReLU(x_i) cos θ_i], θ_i = (π/2) i / M, so that
    φ(q_i)·φ(k_j) = ReLU(q_i)·ReLU(k_j) cos(π/2 (i - j)/M) (Qin et al., ICLR 2022, cosFormer).
    M is fixed (not the current length) so prefill and decoding agree; keep contexts below M."""
    supports_sparse_cache: ClassVar[bool] = False  # φ depends on the position

    name = "cosformer"
    options_cls = CosformerOptions
    horizon_option = "horizon"
    paper = "Qin et al., ICLR 2022, cosFormer"

    @property
    def horizon(self) -> int:
        return self.options.horizon or self.shape.max_positions

    def num_features(self) -> int:
        return 2 * self.shape.head_dim

    def check_positions(self, end: int) -> None:
        if end > self.horizon:
            raise ValueError(
                f"cosformer: {end} tokens exceed its horizon M = {self.horizon} (the model's max_position_embeddings "
                "unless set); beyond M the weight cos(π/2 (i - j) / M) turns negative and the normaliser can vanish. "
                f"Set the kernel option horizon to the longest context, e.g. patch(model, kernel='cosformer', "
                f"horizon={end})"
            )

    def feature(self, x, pos, scaling):
        theta = (math.pi / 2) * pos.to(x.dtype) / self.horizon
        r = torch.relu(x)
        return torch.cat([r * theta.sin()[:, None], r * theta.cos()[:, None]], -1)
