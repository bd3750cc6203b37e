"""``patch()``: swap the attention kernel of a pretrained model in place -- the package's entry point, above
the patching machinery and the automatic layer choice."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import KernelAttentionConfig
from .layer_choice import auto_patch, parse_auto
from .modules import num_attention_layers
from .patching import apply_config


def patch(model: nn.Module, kernel: str, layers: Any = None, calibration: Any = None, **params: Any) -> nn.Module:
    """Swap the attention kernel of ``model`` in place (and return it).

    ``layers``: None (all layers), a list of layer indices that run ``kernel`` (others keep softmax),
    a dict {index: kernel name}, or ``"auto:K"``: the K layers with the largest attention-transfer error on
    ``calibration`` (token ids ``[B, N]`` or a tokenizer's output) stay softmax (integration/layer_choice.py).
    Negative indices count from the end. ``params`` are the kernel's options (see
    ``hf_kernel_attn.available_kernels()``)."""
    if not hasattr(model, "config"):
        raise ValueError(f"patch() needs a transformers PreTrainedModel, got {type(model).__name__}")
    keep = parse_auto(layers, num_attention_layers(model))
    if keep is not None:
        return auto_patch(model, kernel, keep, calibration, **params)
    if calibration is not None:
        raise ValueError("calibration= is only used with layers='auto:K'")
    kcfg = KernelAttentionConfig.create(kernel, layers, num_layers=num_attention_layers(model), **params)
    return apply_config(model, kcfg)
