"""RecurrentStateCache: constant-memory decoding for linear-kernel and windowed-softmax layers.

A transformers ``Cache`` whose layers are a :class:`RecurrentStateLayer` (:mod:`.cache_layers`; linear kernels: keeps
only S = Σ φ(k)vᵀ and z = Σ φ(k) per KV head, never the whole K/V; sliding-window hybrids also keep the
last W - 1 keys/values), a :class:`WindowKVLayer` (softmax with ``window`` W > 0: the S sink keys/values plus
the last W - 1) or a plain ``DynamicLayer`` (other softmax-like kernels in a hybrid model). ``generate`` on a
patched model builds one automatically.

Flow per attention layer (transformers 5.x): the module calls ``cache.update(k, v, layer_idx, kwargs=kw)``
before the attention function; the state layer records the chunk, puts itself into ``kw`` as
``linear_state`` and returns the chunk unchanged; the attention function then calls
:meth:`RecurrentStateLayer.attend`, which runs the chunked causal form from the stored state (prefill)
or one O(F·Dv) update (a decode step) and keeps the final state. A :class:`WindowKVLayer` works the same way
(``window_cache`` in ``kw``; :meth:`WindowKVLayer.attend` gets the raw 2-D padding mask over past + new tokens).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..kernels import Kernel, LinearKernel
from .attention import KERNEL_ATTR, packed_segments
from .cache_layers import RecurrentStateLayer, tensor_bytes
from .modules import attention_modules
from .window_cache import RetentionKVLayer, WindowKVLayer, has_retention_slots, is_windowed_softmax

__all__ = ["CACHE_KWARGS", "RecurrentStateCache", "RecurrentStateLayer", "RetentionKVLayer", "WindowKVLayer",
           "cache_bytes", "cache_kwarg",
           "install_cache_hook", "is_windowed_softmax", "new_cache", "passes_update_kwargs", "remove_cache_hook",
           "wants_state_cache"]


def _cache_layer(kernel: Kernel | None):
    if isinstance(kernel, LinearKernel):
        return RecurrentStateLayer(window=kernel.window)
    if has_retention_slots(kernel):
        return RetentionKVLayer(kernel.options.budget())
    if is_windowed_softmax(kernel):
        return WindowKVLayer(window=kernel.window, sinks=kernel.sinks)
    return DynamicLayer()


def _wants_layer(kernel: Kernel | None) -> bool:
    return isinstance(kernel, LinearKernel) or is_windowed_softmax(kernel)


class RecurrentStateCache(Cache):
    """Per layer: a recurrent state for linear kernels, the sinks and last W - 1 K/V for windowed softmax, a
    growing K/V cache for the others."""

    def __init__(self, model: torch.nn.Module) -> None:
        kernels = [getattr(m, KERNEL_ATTR, None) for m in attention_modules(model)]
        if not any(_wants_layer(k) for k in kernels):
            raise ValueError("RecurrentStateCache needs a model patched with at least one linear kernel or one "
                             "softmax kernel with a window (window > 0)")
        super().__init__(layers=[_cache_layer(k) for k in kernels])

    def nbytes(self) -> int:
        """Bytes held by the cache: recurrent states and windows plus any K/V of softmax-like layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, (RecurrentStateLayer, WindowKVLayer, RetentionKVLayer)):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                total += tensor_bytes(layer.keys, layer.values)
        return total


CACHE_KWARGS = ("cache", "past_key_values")


def _cache_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    """Forward pre-hook on the base model: a call that will cache (``use_cache``, or the config's default in eval
    mode) and passes no cache gets a :class:`RecurrentStateCache` instead of the ``DynamicCache`` the model would
    build, so manual decoding loops and chunked prefill keep constant memory as ``generate()`` does. A cache
    passed by the caller is used as given."""
    if any(kwargs.get(name) is not None for name in CACHE_KWARGS) or torch.compiler.is_compiling():
        return None
    if len(args) > 1:
        return None  # inputs beyond input_ids passed positionally: the cache may be among them
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.bool().all()):
        mask = None
    if packed_segments(kwargs.get("position_ids"), mask, _length(kwargs)) is not None:
        return None  # packed rows: documents are attended one by one, there is nothing to continue
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = bool(getattr(getattr(module, "config", None), "use_cache", False)) and not module.training
    if not use_cache or not wants_state_cache(module):
        return None
    return args, {**kwargs, _cache_parameter(type(module)): RecurrentStateCache(module)}


def _length(kwargs: dict[str, Any]) -> int:
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return int(x.shape[1])
    return 0


@functools.cache
def _cache_parameter(cls: type) -> str | None:
    """The name under which ``cls.forward`` takes its cache (``cache`` in transformers 5, else
    ``past_key_values``), or None."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_KWARGS if name in params), None)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword under which ``model`` (and its ``generate``) takes a cache: ``cache`` where its forward names
    it so (newer transformers), else ``past_key_values``."""
    return _cache_parameter(type(model)) or "past_key_values"


def install_cache_hook(target: torch.nn.Module) -> None:
    """Put :func:`_cache_hook` once on ``target`` (the base model, whose forward builds the cache)."""
    if _cache_parameter(type(target)) is None:
        return
    if not any(h is _cache_hook for h in target._forward_pre_hooks.values()):
        target.register_forward_pre_hook(_cache_hook, with_kwargs=True)


def remove_cache_hook(target: torch.nn.Module) -> None:
    for key in [k for k, h in target._forward_pre_hooks.items() if h is _cache_hook]:
        del target._forward_pre_hooks[key]
        target._forward_pre_hooks_with_kwargs.pop(key, None)


@functools.cache
def passes_update_kwargs(cls: type) -> bool:
    """Whether an attention module's forward hands its kwargs to ``cache.update(..., kwargs=...)``, the hook the
    recurrent cache needs (most transformers 5 models; GPT-NeoX, for one, does not)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return re.search(r"\.update\([^)]*\bkwargs\s*=", src) is not None


def wants_state_cache(model: torch.nn.Module) -> bool:
    """True for a patched model with a linear or windowed-softmax layer whose attention modules pass their
    kwargs to the cache (generate and caching forwards then build a RecurrentStateCache; other models keep
    transformers' own cache, which is correct but grows with the context)."""
    data = getattr(getattr(model, "config", None), "kernel_attention", None)
    if not data:
        return False
    modules = attention_modules(model)
    return (any(_wants_layer(getattr(m, KERNEL_ATTR, None)) for m in modules)
            and all(passes_update_kwargs(type(m)) for m in modules))


def new_cache(model: torch.nn.Module) -> Cache:
    """What ``generate`` would use: a RecurrentStateCache when the model has linear layers, else a DynamicCache."""
    return RecurrentStateCache(model) if wants_state_cache(model) else DynamicCache(config=model.config)


def cache_bytes(cache: Cache) -> int:
    """Bytes a decode cache holds: a RecurrentStateCache counts its own (states, windows, sinks, K/V); any other
    cache is the keys and values of its layers."""
    if isinstance(cache, RecurrentStateCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))
