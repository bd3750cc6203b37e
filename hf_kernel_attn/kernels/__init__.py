"""The kernel registry: one class per name; everything else (names, validation, docs) derives from it."""

from __future__ import annotations

from typing import Any

from .base import Kernel, KernelOptions, LayerShape, make_options
from .cosine import CosineKernel
from .feature_maps import (
    CosformerKernel,
    DijiangKernel,
    EluKernel,
    HedgehogKernel,
    LinearKernel,
    PerformerKernel,
    ReluKernel,
    TaylorKernel,
)
from .gaussian import GaussianKernel
from .skyformer import SkyformerKernel
from .softmax import SoftmaxKernel

KERNELS: dict[str, type[Kernel]] = {
    cls.name: cls
    for cls in (
        SoftmaxKernel, GaussianKernel, CosineKernel, EluKernel, ReluKernel, CosformerKernel,
        PerformerKernel, DijiangKernel, HedgehogKernel, TaylorKernel, SkyformerKernel,
    )
}


def kernel_class(name: str) -> type[Kernel]:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; available kernels: {sorted(KERNELS)}")
    return KERNELS[name]


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


__all__ = ["KERNELS", "Kernel", "LayerShape", "LinearKernel", "build_kernel", "kernel_class", "validate_params"]
