"""A kernel of your own: squared-ReLU features with a learnable per-dimension scale (docs/custom_kernels.md)."""

import torch
from torch import nn

import hf_kernel_attn


@hf_kernel_attn.register_kernel
class SquaredReLU(hf_kernel_attn.FeatureMapKernel):
    """φ(x) = ReLU(x ⊙ a)², with a learnable per-dimension scale a (starts at 1)."""

    name = "sqrelu"

    def __init__(self, shape, options):
        super().__init__(shape, options)
        self.scale = nn.Parameter(torch.ones(shape.head_dim))

    def reset_parameters(self):
        super().reset_parameters()
        nn.init.ones_(self.scale)

    def feature_map(self, x):
        return torch.relu(x * self.scale) ** 2

