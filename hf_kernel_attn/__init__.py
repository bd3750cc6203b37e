"""hf_kernel_attn: swap the attention kernel of a pretrained transformers model.

    import hf_kernel_attn
    model = hf_kernel_attn.from_pretrained("HuggingFaceTB/SmolLM2-135M", kernel="hedgehog")
    hf_kernel_attn.patch(model, kernel="gaussian", layers={0: "softmax"})

After ``import hf_kernel_attn`` every kernel name is registered with transformers' AttentionInterface and
AttentionMaskInterface, so ``attn_implementation="<kernel>"`` works in stock calls too, and saved kernel
checkpoints load. The import itself is cheap (no torch, no transformers): the public names load on first
use, and the registration runs when transformers' model code is imported (see :mod:`._registration`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _registration

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS = {
    "KernelAttentionConfig": ".config",
    "register_kernel": ".integration.attention",
    "convert_gguf": ".integration.loading",
    "from_pretrained": ".integration.loading",
    "kernel_config": ".integration.patching",
    "unpatch": ".integration.patching",
    "patch": ".integration.swap",
    "KERNELS": ".kernels",
    "FeatureMapKernel": ".kernels",
    "Kernel": ".kernels",
    "KernelOptions": ".kernels",
    "LayerShape": ".kernels",
    "LinearOptions": ".kernels",
    "available_kernels": ".catalog",
}

if TYPE_CHECKING:
    from .catalog import available_kernels
    from .config import KernelAttentionConfig
    from .integration.attention import register_kernel
    from .integration.loading import convert_gguf, from_pretrained
    from .integration.patching import kernel_config, unpatch
    from .integration.swap import patch
    from .kernels import KERNELS, FeatureMapKernel, Kernel, KernelOptions, LayerShape, LinearOptions  # noqa: F401


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name on first access (and register the kernels with transformers)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    _registration.activate()
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "FeatureMapKernel", "Kernel", "KernelAttentionConfig", "KernelOptions", "LayerShape", "LinearOptions",
    "available_kernels", "convert_gguf", "from_pretrained", "kernel_config", "patch", "register_kernel", "unpatch",
]

_registration.arm()
