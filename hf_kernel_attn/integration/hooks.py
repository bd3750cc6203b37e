"""Every method of transformers that hf_kernel_attn replaces, as one table, installed and removed by one loop.

A :class:`ClassPatch` names its target (a class attribute), the wrapper that replaces it (built from the original,
which it calls), why it exists and how it is undone. :func:`install_hooks` applies :data:`PATCHES` once per
process (``hf_kernel_attn._registration.activate`` calls it when transformers' model code loads);
:func:`remove_hooks` puts every original back (removes the attribute where the original was inherited), so
transformers is as it was before. Per-model changes (attached kernels, the stored config, two forward pre-hooks)
are made by :func:`~.patching.apply_config` and undone by :func:`~.patching.unpatch`; see :data:`MODEL_CHANGES`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerationMixin

from ..config import CONFIG_KEY
from ..kernels import KERNELS, Kernel
from .cache import CACHE_KWARGS, RecurrentStateCache, wants_state_cache
from .patching import (
    REQUESTED_ATTR,
    apply_config,
    check_loaded_kernels,
    config_for,
    is_gguf_model,
    mark_saved_config,
    module_uses_interface,
    no_interface_message,
    sync_from_config,
    unpatch,
)
from .remote_code import remove_remote_code, write_remote_code


@dataclass(frozen=True)
class ClassPatch:
    """One replaced class attribute: ``owner.name`` becomes ``wrap(original)``."""

    owner: type
    name: str
    wrap: Callable[[Callable], Callable]
    why: str
    undo: str = "the original is put back (the attribute removed where the original was inherited)"
    static: bool = False  # the attribute is a staticmethod: the wrapper wraps its function, and stays static
    optional: bool = False  # absent in some transformers versions: skipped there


# --- the wrappers, one per table row ---------------------------------------------------------------------------

def wrap_post_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def post_init(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        sync_from_config(self)
        return out
    return post_init


def wrap_initialize_weights(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _initialize_weights(self, module, *args, **kwargs):
        if isinstance(module, Kernel):
            tensors = list(module.parameters()) + list(module.buffers())
            loaded = all(getattr(t, "_is_hf_initialized", False) for t in tensors)
            if not (loaded or getattr(module, "_is_hf_initialized", False)):
                with torch.no_grad():
                    module.reset_parameters()
                module._is_hf_initialized = True
            return None
        return orig(self, module, *args, **kwargs)
    return _initialize_weights


class _InitRequests:
    """What the caller asked for at each model construction, by config object.

    ``PreTrainedModel.__init__`` resolves an unset ``attn_implementation`` (to ``"sdpa"``) and writes the result
    into the shared config before the head's inner model is built; some transformers versions then hand that
    resolved value to the inner model's check as if it had been asked for. A check whose value is the one this
    config's previous check resolved to inherits that check's request instead."""

    def __init__(self) -> None:
        self._by_config: dict[int, tuple[weakref.ref, Any, Any]] = {}

    def requested(self, config: Any, value: Any) -> Any:
        entry = self._by_config.get(id(config))
        if entry is not None and entry[0]() is config and entry[2] == value:
            return entry[1]
        return value

    def record(self, config: Any, requested: Any, resolved: Any) -> None:
        key = id(config)
        try:
            ref = weakref.ref(config, lambda _ref: self._by_config.pop(key, None))
        except TypeError:  # not weak-referenceable: nothing to inherit later
            return
        self._by_config[key] = (ref, requested, resolved)


INIT_REQUESTS = _InitRequests()


def wrap_check_attn_implementation(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if not (kwargs.get("is_init_check") or (args and args[0] is True)):
            return orig(self, attn_implementation, *args, **kwargs)
        config = getattr(self, "config", None)
        requested = INIT_REQUESTS.requested(config, attn_implementation)
        object.__setattr__(self, REQUESTED_ATTR, requested)  # before nn.Module's registries exist
        if attn_implementation in KERNELS and not module_uses_interface(type(self)):
            raise ValueError(no_interface_message(type(self).__name__))
        resolved = orig(self, attn_implementation, *args, **kwargs)
        INIT_REQUESTS.record(config, requested, resolved)
        return resolved
    return _check_and_adjust_attn_implementation


def wrap_set_attn_implementation(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str) and attn_implementation in KERNELS:
            apply_config(self, config_for(attn_implementation, getattr(self.config, CONFIG_KEY, None)))
            return None
        if getattr(self.config, CONFIG_KEY, None):
            unpatch(self)  # the model now runs (and saves as) the stock attention asked for
        return orig(self, attn_implementation, *args, **kwargs)
    return set_attn_implementation


def wrap_finalize_model_loading(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _finalize_model_loading(model, load_config, loading_info, *args, **kwargs):
        check_loaded_kernels(model, loading_info)
        return orig(model, load_config, loading_info, *args, **kwargs)
    return _finalize_model_loading


def wrap_save_pretrained(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if is_gguf_model(self):
            raise ValueError(
                "this model was loaded from a GGUF file and transformers cannot save it; convert it to a normal "
                "checkpoint first with hf_kernel_attn.convert_gguf(path, gguf_file, output_dir) or "
                "`hf-kernel-attn convert-gguf`"
            )
        out = orig(self, save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return out
        if getattr(self.config, CONFIG_KEY, None):
            mark_saved_config(save_directory)
            write_remote_code(save_directory, self.config)
        else:
            remove_remote_code(save_directory)
        return out
    return save_pretrained


def wrap_prepare_cache(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # generate's cache is model_kwargs["cache"] (newer transformers) or ["past_key_values"] (older ones)
        user_cache = any(model_kwargs.get(name) is not None for name in CACHE_KWARGS)
        out = orig(self, generation_config, model_kwargs, *args, **kwargs)
        for name in CACHE_KWARGS:
            if not user_cache and type(model_kwargs.get(name)) is DynamicCache and wants_state_cache(self):
                model_kwargs[name] = RecurrentStateCache(self)
        return out
    return _prepare_cache_for_generation


PATCHES: tuple[ClassPatch, ...] = (
    ClassPatch(PreTrainedModel, "post_init", wrap_post_init,
               "attach the kernels when the model's config names one (a kernel name, or a saved kernel model)"),
    ClassPatch(PreTrainedModel, "_initialize_weights", wrap_initialize_weights,
               "kernel parameters a checkpoint does not hold get the kernel's own init, not the model's"),
    ClassPatch(PreTrainedModel, "_check_and_adjust_attn_implementation", wrap_check_attn_implementation,
               "remember what the caller asked for (an explicit stock attention on a saved kernel model wins) "
               "and refuse a kernel for a model that does not call AttentionInterface"),
    ClassPatch(PreTrainedModel, "set_attn_implementation", wrap_set_attn_implementation,
               "a kernel name attaches kernels; a stock name on a kernel model unpatches it first"),
    ClassPatch(PreTrainedModel, "_finalize_model_loading", wrap_finalize_model_loading,
               "a saved kernel model whose checkpoint lacks or mis-shapes its kernel tensors raises",
               static=True, optional=True),
    ClassPatch(PreTrainedModel, "save_pretrained", wrap_save_pretrained,
               "GGUF models get a conversion hint; kernel models are marked in config.json (loading them without "
               "hf_kernel_attn fails loudly) and get their remote-code files"),
    ClassPatch(GenerationMixin, "_prepare_cache_for_generation", wrap_prepare_cache,
               "generate() on a model with linear kernels or windowed softmax decodes with the bounded "
               "RecurrentStateCache unless the caller passed a cache"),
)

MODEL_CHANGES: tuple[tuple[str, str, str], ...] = (
    # (what apply_config changes on a model, why, how unpatch undoes it)
    ("a `kernel_attn` submodule on every attention module", "the kernel and its parameters", "deleted"),
    (f"`config.{CONFIG_KEY}`", "the choice, saved with the model", "deleted, with remote-code auto_map entries"),
    ("`config._attn_implementation_internal` (and its copies in sub-configs)", "selects the kernel",
     "set to the stock attention asked for (sdpa by default)"),
    ("a forward pre-hook on the decoder stack (left-padded position ids)", "integration/positions.py", "removed"),
    ("a forward pre-hook on the decoder stack (the recurrent cache)", "integration/cache.py", "removed"),
)

_INHERITED = object()  # the original attribute lived on a base class
_originals: dict[tuple[type, str], Any] = {}


def _applies(patch: ClassPatch) -> bool:
    found = patch.owner.__dict__.get(patch.name)
    if patch.static:
        return isinstance(found, staticmethod)
    return hasattr(patch.owner, patch.name) or not patch.optional


def installed() -> bool:
    """Whether :data:`PATCHES` are in place."""
    return bool(_originals)


def install_hooks() -> None:
    """Replace every applicable attribute of :data:`PATCHES` by its wrapper (idempotent)."""
    if _originals:
        return
    for patch in PATCHES:
        if not _applies(patch):
            continue
        if not hasattr(patch.owner, patch.name):
            raise AttributeError(f"transformers has no {patch.owner.__name__}.{patch.name} to wrap ({patch.why})")
        saved = patch.owner.__dict__.get(patch.name, _INHERITED)
        if patch.static:
            replacement: Any = staticmethod(patch.wrap(saved.__func__))
        else:
            replacement = patch.wrap(getattr(patch.owner, patch.name))
        _originals[(patch.owner, patch.name)] = saved
        setattr(patch.owner, patch.name, replacement)


def remove_hooks() -> None:
    """Undo :func:`install_hooks`: every original back, in reverse order."""
    for (owner, name), saved in reversed(list(_originals.items())):
        if saved is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)
    _originals.clear()
