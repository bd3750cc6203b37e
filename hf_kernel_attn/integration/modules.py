"""Which modules of a model are attention layers this plugin can patch (a leaf module: patching, caches and
layer choice all ask it)."""

from __future__ import annotations

import functools
import inspect

from torch import nn

from ..kernels import Kernel


@functools.cache
def _routes_through_interface(cls: type) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules whose forward calls transformers' AttentionInterface, in model order."""
    return [m for m in model.modules() if not isinstance(m, Kernel) and _routes_through_interface(type(m))]


def num_attention_layers(model: nn.Module) -> int:
    return len(attention_modules(model))
