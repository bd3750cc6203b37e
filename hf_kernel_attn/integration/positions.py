"""Left padding in a plain forward: derive ``position_ids`` from the 2-D padding mask, as ``generate()`` does.

Feature maps act on RoPE-rotated (or position-embedded) q/k. Without ``position_ids`` transformers numbers
every column, pads included, so a left-padded row sees its tokens at shifted positions: harmless for the
shift-invariant softmax-like kernels on RoPE models, a silent logit change for feature-map kernels (and for
every kernel on models with learned absolute positions, such as GPT-2).

:func:`install` puts a forward pre-hook on the model's base module (``LlamaModel``, ``GPT2Model``, ...). When a
call passes a 2-D ``attention_mask`` that contains padding and no ``position_ids``, the hook adds
``position_ids = cumsum(mask) - 1`` (pads set to 0), restricted to the new tokens when a cache holds a past,
exactly as ``GenerationMixin._prepare_position_ids_for_generation``. Calls that already pass positions
(``generate`` does), and calls without a mask or whose mask has no padding, are left untouched. A padded mask
whose length does not match past + new tokens cannot be read safely: the hook raises instead of guessing.
Installed for causal models only (encoders are usually right-padded, where positions are unaffected).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ..config import CONFIG_KEY

CACHE_KWARGS = ("cache", "past_key_values")
INPUT_KWARGS = ("input_ids", "inputs_embeds")


@functools.cache
def _signature(cls: type) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


def accepts_positions(module: nn.Module) -> bool:
    """True when ``module.forward`` takes both ``attention_mask`` and ``position_ids``."""
    sig = _signature(type(module))
    return sig is not None and {"attention_mask", "position_ids"} <= set(sig.parameters)


def positions_from_mask(mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``cumsum(mask) - 1`` with pads at 0 (generate's rule), last ``new_tokens`` columns: ``[B, new_tokens]``."""
    mask = mask.long()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return pos[:, -new_tokens:]


def _past_length(cache: Any) -> int:
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    if get is None:  # legacy tuple caches: ((k, v), ...) with k [B, H, past, D]
        try:
            return int(cache[0][0].shape[-2])
        except (TypeError, IndexError, AttributeError):
            return 0
    return int(get())


def _new_tokens(arguments: dict[str, Any]) -> int | None:
    for name in INPUT_KWARGS:
        x = arguments.get(name)
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return int(x.shape[1])
    return None


def _hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Forward pre-hook: add ``position_ids`` for a padded 2-D mask when the caller gave none."""
    if not getattr(getattr(module, "config", None), CONFIG_KEY, None):
        return None  # unpatched since: stock behaviour
    sig = _signature(type(module))
    if sig is None:
        return None
    try:
        bound = sig.bind_partial(module, *args, **kwargs)
    except TypeError:
        return None  # let the model's own forward report the bad call
    arguments = dict(bound.arguments)
    for param in sig.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(param.name, None) or {})
    mask = arguments.get("attention_mask")
    if arguments.get("position_ids") is not None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if not torch.compiler.is_compiling() and bool(mask.to(torch.bool).all()):
        return None  # no padding: the model's own arange is already right (compiled: derived anyway, equal)
    new = _new_tokens(arguments)
    if new is None:
        return None
    cache = None
    for name in CACHE_KWARGS:  # a plain loop: torch.compile before 2.9 cannot trace next() over a generator
        if arguments.get(name) is not None:
            cache = arguments[name]
            break
    past = _past_length(cache)
    if mask.shape[1] != past + new:
        raise ValueError(
            f"hf_kernel_attn derives position_ids from a padded 2-D attention_mask, but the mask has {mask.shape[1]} "
            f"columns while the cache holds {past} past tokens and the call adds {new} (expected {past + new}). "
            "Pass an attention_mask covering past and new tokens, or pass position_ids yourself."
        )
    pos = positions_from_mask(mask, new).to(mask.device)
    index = list(sig.parameters).index("position_ids") - 1  # without self
    if index < len(args):  # passed positionally (as None)
        return (*args[:index], pos, *args[index + 1:]), kwargs
    return args, {**kwargs, "position_ids": pos}


def target_module(model: nn.Module) -> nn.Module | None:
    """The module whose forward turns positions into embeddings: the base model (``model.base_model``)."""
    base = getattr(model, "base_model", None)
    for candidate in (base, model):
        if isinstance(candidate, nn.Module) and accepts_positions(candidate):
            return candidate
    return None


def _hook_keys(module: nn.Module) -> list[int]:
    return [k for k, h in module._forward_pre_hooks.items() if h is _hook]


def install(model: nn.Module) -> bool:
    """Install the hook once on the base module of a causal ``model``; returns whether it is installed."""
    target = target_module(model)
    if target is None:
        return False
    if not _hook_keys(target):
        target.register_forward_pre_hook(_hook, with_kwargs=True)
    return True


def remove(model: nn.Module) -> None:
    """Remove the hook (no error when absent)."""
    target = target_module(model)
    if target is None:
        return
    for key in _hook_keys(target):
        del target._forward_pre_hooks[key]
        target._forward_pre_hooks_with_kwargs.pop(key, None)
