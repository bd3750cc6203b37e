"""elu + 1: φ(x) = elu(x) + 1 (Katharopoulos et al., ICML 2020)."""

from __future__ import annotations

import torch

from .base import LinearKernel


def positive_elu(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 written as exp(min(x, 0)) + max(x, 0): no cancellation for x ≪ 0 (elu(x) + 1 rounds
    exp(x) - 1 + 1 to 0), no inf in backward."""
    if x.requires_grad:
        return torch.exp(x.clamp_max(0)) + torch.relu(x)
    return x.clamp_max(0).exp_().add_(x.clamp_min(0))


class EluKernel(LinearKernel):
    """φ(x) = elu(x) + 1 (Katharopoulos et al., ICML 2020)."""

    name = "elu"
    paper = "Katharopoulos et al., ICML 2020, Transformers are RNNs"

    def feature(self, x, pos, scaling):
        return positive_elu(x)
