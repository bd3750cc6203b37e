"""Attach kernels to a transformers model, persist the choice in its config, and rebuild on load.

Three entry points share one implementation (:func:`apply_config`):

* :func:`patch` — a model already in memory;
* ``from_pretrained(..., attn_implementation=<kernel>)`` / ``set_attn_implementation(<kernel>)`` —
  through the hooks of :mod:`.hooks` on ``PreTrainedModel``;
* loading a saved kernel model — ``post_init`` reads ``config.kernel_attention`` and attaches the
  kernel modules before the checkpoint (which holds their parameters) is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import sys
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ..config import CONFIG_KEY, KernelAttentionConfig, LayerChoice
from ..fileio import write_json_atomic
from ..kernels import KERNELS, SOFTMAX, Kernel, LayerShape, build_kernel, kernel_class
from ..kernels.registry import causal_only_kernels
from . import positions
from .attention import KERNEL_ATTR, SAVED_NAME
from .cache import install_cache_hook, remove_cache_hook
from .modules import attention_modules
from .remote_code import forget_remote_code


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def layer_shape(config: Any, module: nn.Module, idx: int) -> LayerShape:
    text = _text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"cannot find num_attention_heads in {type(config).__name__}")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = (
        getattr(module, "head_dim", None)
        or getattr(module, "attention_head_size", None)
        or getattr(text, "head_dim", None)
        or text.hidden_size // heads
    )
    max_pos = getattr(text, "max_position_embeddings", None) or 2048
    return LayerShape(int(heads), int(kv_heads), int(head_dim), idx, int(max_pos))


def no_interface_message(name: str) -> str:
    return (f"{name} does not dispatch its attention through transformers' AttentionInterface, so hf_kernel_attn "
            "cannot swap its kernel (supported: Llama/SmolLM2, Qwen2, Mistral, GPT-2, BERT/MiniLM, T5, and the other "
            "models whose attention calls ALL_ATTENTION_FUNCTIONS; docs/architectures.md lists the tested ones)")


@functools.cache
def module_uses_interface(cls: type) -> bool:
    """Whether the modeling file of a model class calls transformers' AttentionInterface at all (Falcon, BLOOM,
    GPT-Neo do not: they pick attention classes from their own table, which knows no kernel name)."""
    module = sys.modules.get(cls.__module__)
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)
    except (OSError, TypeError):
        return True  # no source to read: let the per-module check decide after __init__


def _check_model(model: nn.Module, modules: list[nn.Module], kcfg: KernelAttentionConfig) -> None:
    if not modules:
        raise ValueError(no_interface_message(type(model).__name__))
    bad = [i for i in kcfg.layers if i >= len(modules)]
    if bad:
        raise ValueError(f"layer index {bad} out of range: the model has {len(modules)} attention layers")
    for i, module in enumerate(modules):
        name = kcfg.for_layer(i).kernel
        if getattr(module, "is_causal", False) and not kernel_class(name).supports_causal:
            raise ValueError(
                f"kernel {name!r} is bidirectional only and cannot run layer {i} of the causal model "
                f"{type(model).__name__}; choose a causal kernel: "
                f"{sorted(n for n, c in KERNELS.items() if c.supports_causal)}"
            )
        if getattr(module, "is_causal", None) is False and not kernel_class(name).supports_bidirectional:
            raise ValueError(
                f"kernel {name!r} is causal only and cannot run layer {i} of the bidirectional model (an encoder) "
                f"{type(model).__name__}; the causal-only kernels are {causal_only_kernels()}; choose one of "
                f"{sorted(n for n, c in KERNELS.items() if c.supports_bidirectional)}"
            )


def native_window(model: nn.Module, module: nn.Module) -> int | None:
    """The sliding window W a layer of the host model attends over (its ``sliding_window`` argument to the
    attention function: keys with i - W < j ≤ i, or |i - j| < W in an encoder), or None for a global layer."""
    if hasattr(module, "is_sliding"):  # EXAONE-4: the window is set on every layer, used on the sliding ones
        window = getattr(module, "sliding_window", None) if module.is_sliding else None
    elif "sliding_window" in vars(module):  # Qwen2, Gemma 2/3, Cohere2, ModernBERT, ...: per layer
        window = module.sliding_window
    else:  # Mistral: the config's window on every layer
        window = getattr(getattr(module, "config", None) or _text_config(model.config), "sliding_window", None)
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def keep_native_windows(model: nn.Module, modules: list[nn.Module], kcfg: KernelAttentionConfig) -> None:
    """Layers with a native sliding window keep it: they run exact softmax over that window (cheap already)
    unless their kernel choice has a window of its own (``window=W``: the opt-in to convert them too)."""
    for i, module in enumerate(modules):
        window = native_window(model, module)
        if window is None:
            continue
        choice = kcfg.for_layer(i)
        if choice.params.get("window", 0):
            continue
        kcfg.layers[i] = LayerChoice(SOFTMAX, {"window": window})


def _attach(model: nn.Module, modules: list[nn.Module], kcfg: KernelAttentionConfig) -> None:
    for i, module in enumerate(modules):
        choice = kcfg.for_layer(i)
        shape = layer_shape(model.config, module, i)
        existing = getattr(module, KERNEL_ATTR, None)
        options = kernel_class(choice.kernel).options_cls(**choice.params)
        if isinstance(existing, Kernel) and (existing.name, existing.shape, existing.options) == (
            choice.kernel, shape, options
        ):
            continue
        ref = next(module.parameters(), None)
        device = ref.device if ref is not None else torch.device("cpu")
        with torch.device(device):
            kernel = build_kernel(choice.kernel, shape, choice.params)
        if ref is not None and ref.is_floating_point() and not ref.is_meta:
            kernel.to(dtype=ref.dtype)
        if _only_heads_differ(existing, kernel):  # a head choice keeps the trained feature maps
            kernel.load_state_dict(existing.state_dict())
        setattr(module, KERNEL_ATTR, kernel)


def _only_heads_differ(old: Any, new: Kernel) -> bool:
    """Same kernel and layer, options equal but for ``softmax_heads``."""
    if not isinstance(old, Kernel) or (old.name, old.shape) != (new.name, new.shape):
        return False
    if not hasattr(old.options, "softmax_heads"):
        return False
    return dataclasses.replace(old.options, softmax_heads=new.options.softmax_heads) == new.options


def apply_config(model: nn.Module, kcfg: KernelAttentionConfig) -> nn.Module:
    """Validate ``kcfg`` against ``model``, attach kernels, store the config, select the kernel."""
    modules = attention_modules(model)
    _check_model(model, modules, kcfg)
    keep_native_windows(model, modules, kcfg)
    _attach(model, modules, kcfg)
    setattr(model.config, CONFIG_KEY, kcfg.to_dict())
    _set_attention_name(model, modules, kcfg.kernel)
    if any(getattr(m, "is_causal", False) for m in modules):
        # a left-padded plain forward gets generate()'s position_ids (integration/positions.py), and a plain
        # forward that caches gets the recurrent cache (integration/cache.py)
        positions.install(model)
        target = positions.target_module(model)
        if target is not None:
            install_cache_hook(target)
    return model


def _set_attention_name(model: nn.Module, modules: list[nn.Module], name: str) -> None:
    """Select ``name`` in the model's config and in every config object its attention modules read (T5 gives
    its encoder and decoder stacks copies of the config)."""
    model.config._attn_implementation_internal = name
    seen = {id(model.config)}
    for module in modules:
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation_internal"):
            seen.add(id(config))
            config._attn_implementation_internal = name


def unpatch(model: nn.Module, attn_implementation: str = "sdpa") -> nn.Module:
    """Remove every attached kernel, the stored choice and the remote-code ``auto_map`` entries; the model runs
    ``attn_implementation`` again (and saves as the stock model)."""
    positions.remove(model)
    target = positions.target_module(model)
    if target is not None:
        remove_cache_hook(target)
    for module in attention_modules(model):
        if hasattr(module, KERNEL_ATTR):
            delattr(module, KERNEL_ATTR)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    forget_remote_code(model.config)
    _set_attention_name(model, attention_modules(model), attn_implementation)
    return model


def kernel_config(model: nn.Module) -> KernelAttentionConfig | None:
    data = getattr(model.config, CONFIG_KEY, None)
    return KernelAttentionConfig.from_dict(data) if data else None


def config_for(impl: str, data: dict | None) -> KernelAttentionConfig:
    """The stored config when it is for kernel ``impl``, else ``impl`` with default options."""
    if data and data.get("kernel") == impl:
        return KernelAttentionConfig.from_dict(data)
    return KernelAttentionConfig.create(impl)


REQUESTED_ATTR = "_hf_kernel_attn_requested"


def _stock_request(model: nn.Module, impl: Any) -> str | None:
    """The stock attention (``"sdpa"``, ``"eager"``, ...) the caller asked for explicitly, else None. transformers
    resolves an unset choice to ``"sdpa"`` in ``__init__``; the value before that is recorded in
    :data:`REQUESTED_ATTR` by the hook on ``_check_and_adjust_attn_implementation``."""
    requested = getattr(model, REQUESTED_ATTR, impl)
    if isinstance(requested, dict):
        requested = requested.get("")
    if isinstance(requested, str) and requested not in KERNELS and requested != SAVED_NAME:
        return requested
    return None


_DROPPED: dict[int, weakref.ref] = {}  # configs whose saved kernel an explicit stock request dropped


def _ignore_kernel_tensors(model: nn.Module) -> None:
    """The checkpoint's ``*.kernel_attn.*`` tensors are expected and unused: not in transformers' load report."""
    ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    pattern = r"\.kernel_attn\."
    if isinstance(ignore, set):  # transformers from 5.4 keep them as a set (collected from the submodels)
        model._keys_to_ignore_on_load_unexpected = {*ignore, pattern}
    else:
        model._keys_to_ignore_on_load_unexpected = [*(ignore or []), pattern]


def _drop_saved_kernel(model: nn.Module, impl: str, data: dict) -> None:
    """An explicit stock ``attn_implementation`` on a saved kernel model wins: the model is the base model with
    that attention, its config forgets the kernel (so it saves as what runs), and its kernel tensors are ignored
    on load, said once here instead of as transformers' unexpected-keys report."""
    config = model.config
    delattr(config, CONFIG_KEY)
    forget_remote_code(config)
    _ignore_kernel_tensors(model)
    key = id(config)
    with contextlib.suppress(TypeError):  # the models built on this config later (the head around this one)
        _DROPPED[key] = weakref.ref(config, lambda _ref: _DROPPED.pop(key, None))
    warnings.warn(
        f"attn_implementation={impl!r} was requested for a model saved with the hf_kernel_attn kernel "
        f"{data.get('kernel')!r} (config.{CONFIG_KEY}): it runs {impl!r} attention, the checkpoint's kernel tensors "
        "(*.kernel_attn.*) are unused, and save_pretrained() saves it as the stock model. Load it without "
        "attn_implementation to run the kernel.",
        UserWarning,
        stacklevel=3,
    )


def sync_from_config(model: nn.Module) -> None:
    """Called after every PreTrainedModel.__init__: attach kernels when the config asks for them."""
    config = getattr(model, "config", None)
    if config is None:
        return
    impl = getattr(config, "_attn_implementation_internal", None)
    data = getattr(config, CONFIG_KEY, None)
    dropped = _DROPPED.get(id(config))
    if not data and dropped is not None and dropped() is config:
        # a head built around the model that dropped the kernel: transformers before 5.4 reports unexpected keys
        # from the outer model's own patterns only
        _ignore_kernel_tensors(model)
    stock = _stock_request(model, impl) if data else None
    if stock is not None:
        _drop_saved_kernel(model, stock, data)
        return
    if impl in KERNELS:
        kcfg = config_for(impl, data)
    elif data:  # a saved kernel model (its config names SAVED_NAME, or the name was dropped on save)
        kcfg = KernelAttentionConfig.from_dict(data)
        model._hf_kernel_attn_saved = True  # its checkpoint must hold the kernel parameters (check_loaded_kernels)
    elif impl == SAVED_NAME:
        raise ValueError(f"config asks for hf_kernel_attn but has no config.{CONFIG_KEY}; the checkpoint is incomplete")
    else:
        return
    apply_config(model, kcfg)
    # kernel parameters absent from a softmax checkpoint are expected: they get the kernel's own init
    ignore = getattr(model, "_keys_to_ignore_on_load_missing", None)
    if isinstance(ignore, set):
        ignore.add(r"\.kernel_attn\.")


def check_loaded_kernels(model: nn.Module, loading_info: Any) -> None:
    """A saved kernel model whose checkpoint lacks kernel parameters, holds them with other shapes, or holds
    kernel tensors its configured kernels do not have (config.json edited) is incomplete or corrupted: raise,
    naming the tensors, instead of silently re-initialising or dropping them."""
    # the flag sits on whichever module's post_init read the saved config first (the base model inside a head)
    if not any(getattr(m, "_hf_kernel_attn_saved", False) for m in model.modules()):
        return  # a softmax checkpoint loaded with a kernel: its kernel parameters get their own init
    missing = sorted(k for k in getattr(loading_info, "missing_keys", ()) if f".{KERNEL_ATTR}." in k)
    mismatched = sorted(m for m in getattr(loading_info, "mismatched_keys", ()) if f".{KERNEL_ATTR}." in m[0])
    unexpected = sorted(k for k in getattr(loading_info, "unexpected_keys", ()) if f".{KERNEL_ATTR}." in k)
    if not (missing or mismatched or unexpected):
        return
    kcfg = getattr(model.config, CONFIG_KEY, {}) or {}
    problems = []
    if missing:
        problems.append(f"missing: {missing}")
    if mismatched:
        problems.append("mis-shaped: " + ", ".join(f"{k} (checkpoint {list(got)}, kernel expects {list(want)})"
                                                   for k, got, want in mismatched))
    if unexpected:
        problems.append(f"unexpected (not parameters of the configured kernels): {unexpected}")
    raise ValueError(
        f"the checkpoint of this saved kernel model (config.{CONFIG_KEY} = {kcfg!r}) does not hold the kernel "
        f"parameters it was saved with; {'; '.join(problems)}. The checkpoint is incomplete, corrupted, or its "
        f"config.json was edited to another kernel or option; restore it, or load the base model and patch() it"
    )


def is_gguf_model(model: nn.Module) -> bool:
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "gguf"


def mark_saved_config(save_directory: str | os.PathLike) -> None:
    path = os.path.join(save_directory, "config.json")
    with open(path) as f:
        data = json.load(f)
    data["attn_implementation"] = SAVED_NAME
    write_json_atomic(path, data)
