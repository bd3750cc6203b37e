"""The kernel registry: one class per name; everything else (names, validation, docs) derives from it."""

from __future__ import annotations

from typing import Any

from .base import Kernel, KernelOptions, LayerShape, make_options
from .cosine import CosineKernel
from .deltanet import DeltaNetKernel, DeltaNetOptions, GatedDeltaNetKernel, GatedDeltaNetOptions
from .feature_map_kernel import FeatureMapKernel
from .feature_maps import (
    CosformerKernel,
    DijiangKernel,
    EluKernel,
    GatedKernel,
    GlaKernel,
    HedgehogKernel,
    LigerKernel,
    LinearKernel,
    LinearOptions,
    PerformerKernel,
    ReluKernel,
    TaylorKernel,
)
from .gaussian import GaussianKernel
from .registry import KERNELS, add_kernel, defining_module, import_modules, is_builtin, kernel_class
from .skyformer import SkyformerKernel
from .softmax import SoftmaxKernel

SOFTMAX = "softmax"  # the reference kernel: the model's own attention

for _cls in (SoftmaxKernel, GaussianKernel, CosineKernel, EluKernel, ReluKernel, CosformerKernel, PerformerKernel,
             DijiangKernel, HedgehogKernel, TaylorKernel, SkyformerKernel, LigerKernel, GlaKernel, DeltaNetKernel,
             GatedDeltaNetKernel):
    add_kernel(_cls)


def is_softmax(name: str) -> bool:
    """Whether ``name`` is the model's own softmax attention (the reference every other kernel is compared to)."""
    return name == SOFTMAX


def validate_params(name: str, params: dict[str, Any]) -> KernelOptions:
    cls = kernel_class(name)
    return make_options(cls.options_cls, name, params)


def build_kernel(name: str, shape: LayerShape, params: dict[str, Any] | None = None) -> Kernel:
    """Instantiate kernel ``name`` for one layer, validating ``params``."""
    cls = kernel_class(name)
    kernel = cls(shape, make_options(cls.options_cls, name, dict(params or {})))
    if not any(t.is_meta for t in kernel.state_dict().values()):
        kernel.reset_parameters()  # on the meta device the host model initialises it after loading
    return kernel


__all__ = ["KERNELS", "SOFTMAX", "DeltaNetKernel", "DeltaNetOptions", "FeatureMapKernel", "GatedDeltaNetKernel",
           "GatedDeltaNetOptions", "GatedKernel", "Kernel", "KernelOptions", "LayerShape",
           "LinearKernel", "LinearOptions", "add_kernel", "build_kernel", "defining_module", "import_modules",
           "is_builtin", "is_softmax", "kernel_class", "validate_params"]
