"""The kernel choices of a training config against the loaded model, checked before anything is written or
trained: every layer index against the model's attention layers, and every layer's kernel (as training runs it and
as the final model is saved) built for that layer's shape, so that a bad choice fails in seconds with a
:class:`~hf_kernel_attn.configfile.ConfigError` naming its key.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..config import CONFIG_KEY, KernelAttentionConfig, LayerChoice
from ..configfile import ConfigError
from ..integration.layer_choice import parse_auto
from ..integration.loading import with_saved_kernel_options
from ..integration.modules import attention_modules
from ..integration.patching import keep_native_windows, layer_shape
from ..kernels import build_kernel, validate_params


def check_against_model(config: dict[str, Any], model: nn.Module) -> KernelAttentionConfig:
    """Check the kernel choices of a training ``config`` against the loaded ``model`` (before it is patched, and
    before anything is written or trained): every ``layers`` and ``inference_layers`` index against the model's
    attention layers, and every layer's kernel as training runs it (``kernel_params``, ``layers``) and as the
    final model will be saved (``inference_params``, ``inference_layers`` on top) built for that layer's shape
    (heads, head size, positions), so that an option the layer cannot take (``softmax_heads`` beyond its query
    heads, say) fails now with the kernel's own message. Raises a :class:`ConfigError` (a ``ValueError``) that
    names the key; returns the per-layer choice training starts from (``layers: auto:K``: every layer on the
    kernel, as patched before the choice)."""
    kcfg = training_kernel_config(config, model)
    check_inference_options(config, model, kcfg)
    return kcfg


def training_kernel_config(config: dict[str, Any], model: nn.Module) -> KernelAttentionConfig:
    """The per-layer kernel choice :meth:`ModelSetup.load` patches ``model`` with (native sliding windows kept, as
    :func:`~hf_kernel_attn.integration.patching.apply_config` keeps them), each layer's kernel built once for its
    shape; errors name ``kernel_params`` or ``layers``."""
    modules = attention_modules(model)
    count = len(modules)
    layers = None if parse_auto(config["layers"]) is not None else config["layers"]
    try:
        validate_params(config["kernel"], config["kernel_params"])
    except ValueError as exc:
        raise ConfigError(f"kernel_params: {exc}") from None
    if isinstance(layers, dict):
        for idx, choice in layers.items():
            _check_index("layers", idx, f"({choice!r})", count, negative=True)
    elif isinstance(layers, list):
        for idx in layers:
            _check_index("layers", idx, f"in {layers!r}", count, negative=True)
    try:
        kcfg = KernelAttentionConfig.create(config["kernel"], layers, num_layers=count, **config["kernel_params"])
    except ValueError as exc:
        raise ConfigError(f"layers: {exc}") from None
    explicit = set(kcfg.layers) if isinstance(layers, dict) else set()
    keep_native_windows(model, modules, kcfg)
    for i, module in enumerate(modules):
        where = f"layers.{i}" if i in explicit else f"kernel_params (layer {i})"
        _check_kernel(where, kcfg.for_layer(i), model, module, i)
    return kcfg


def check_inference_options(config: dict[str, Any], model: nn.Module, kcfg: KernelAttentionConfig) -> None:
    """The final model's kernels: ``kcfg`` (the choice training ends with) with ``inference_params`` and
    ``inference_layers`` added as the final save adds them, each changed layer's kernel built for its shape;
    errors name ``inference_params`` or ``inference_layers.<index>``."""
    options, per_layer = config["inference_params"], config["inference_layers"]
    if not options and not per_layer:
        return
    modules = attention_modules(model)
    for idx, extra in per_layer.items():
        _check_index("inference_layers", idx, f"({extra!r})", len(modules), negative=False)
    # what the final save reads of the model's config: the stored kernel choice and the layer count
    saved = SimpleNamespace(**{CONFIG_KEY: kcfg.to_dict(),
                               "num_hidden_layers": getattr(model.config, "num_hidden_layers", None)})
    try:
        with_options = with_saved_kernel_options(saved, options)
    except ValueError as exc:
        raise ConfigError(f"inference_params: {exc}") from None
    try:
        final = KernelAttentionConfig.from_dict(
            getattr(with_saved_kernel_options(with_options, {}, per_layer), CONFIG_KEY))
    except ValueError as exc:
        raise ConfigError(f"inference_layers: {exc}") from None
    given = {int(i) for i in per_layer}
    for i, module in enumerate(modules):
        choice = final.for_layer(i)
        if choice != kcfg.for_layer(i):
            where = f"inference_layers.{i}" if i in given else f"inference_params (layer {i})"
            _check_kernel(where, choice, model, module, i)


def _check_index(key: str, idx: Any, shown: str, count: int, negative: bool) -> None:
    """``idx`` (an int, or a string of one) is a layer of a model with ``count`` attention layers (``negative``:
    counted from the end too); ``shown`` follows the index in the error (its value)."""
    i = int(idx) if isinstance(idx, str) and idx.strip().lstrip("-").isdigit() else idx
    if not isinstance(i, int) or isinstance(i, bool):
        return  # not an index at all: KernelAttentionConfig says so
    if not (-count if negative else 0) <= i < count:
        valid = f"0..{count - 1}" + (f", or -{count}..-1" if negative else "")
        raise ConfigError(f"{key}: layer index {i} {shown} out of range: the model has {count} attention layers "
                          f"(valid indices {valid})")


def _check_kernel(where: str, choice: LayerChoice, model: nn.Module, module: nn.Module, idx: int) -> None:
    """Build layer ``idx``'s kernel as the loader would (on the meta device: no memory), for its errors only."""
    shape = layer_shape(model.config, module, idx)
    try:
        try:
            with torch.device("meta"):
                build_kernel(choice.kernel, shape, choice.params)
        except (NotImplementedError, RuntimeError):  # a constructor that reads tensor values: on the CPU then
            build_kernel(choice.kernel, shape, choice.params)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
