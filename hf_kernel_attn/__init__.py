"""hf_kernel_attn: swap the attention kernel of a pretrained transformers model.

    import hf_kernel_attn
    model = hf_kernel_attn.from_pretrained("HuggingFaceTB/SmolLM2-135M", kernel="hedgehog")
    hf_kernel_attn.patch(model, kernel="gaussian", layers={0: "softmax"})

Importing the package registers every kernel name with transformers' AttentionInterface and
AttentionMaskInterface, so ``attn_implementation="<kernel>"`` works in stock calls too.
"""

from __future__ import annotations

from typing import Any

from .config import KernelAttentionConfig
from .integration.attention import register as _register
from .integration.attention import register_kernel
from .integration.loading import convert_gguf, from_pretrained
from .integration.patching import install_hooks as _install_hooks
from .integration.patching import kernel_config, unpatch
from .integration.swap import patch
from .kernels import KERNELS, FeatureMapKernel, Kernel, KernelOptions, LayerShape, LinearOptions

__version__ = "0.1.0"


def available_kernels() -> dict[str, dict[str, Any]]:
    """Every registered kernel: its kind, causal/bidirectional support, options with defaults, paper."""
    import dataclasses

    out = {}
    for name, cls in KERNELS.items():
        out[name] = {
            "kind": cls.kind,
            "causal": cls.supports_causal,
            "bidirectional": cls.supports_bidirectional,
            "options": {f.name: f.default for f in dataclasses.fields(cls.options_cls)},
            "paper": cls.paper,
            "module": cls.__module__,
        }
    return out


_register()
_install_hooks()

__all__ = [
    "FeatureMapKernel", "Kernel", "KernelAttentionConfig", "KernelOptions", "LayerShape", "LinearOptions",
    "available_kernels", "convert_gguf", "from_pretrained", "kernel_config", "patch", "register_kernel", "unpatch",
]
