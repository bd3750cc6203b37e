"""ReLU: φ(x) = ReLU(x)."""

from __future__ import annotations

import torch

from .base import LinearKernel


class ReluKernel(LinearKernel):
    """φ(x) = ReLU(x) (as in cosFormer / T2R without the learned projection)."""

    name = "relu"
    paper = "Kasai et al., EMNLP 2021 (T2R); Qin et al., ICLR 2022 (cosFormer)"

    def feature(self, x, pos, scaling):
        return torch.relu(x)
