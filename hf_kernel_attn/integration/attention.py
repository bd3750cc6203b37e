"""The attention and mask functions registered with transformers (one dispatcher for every kernel).

``attention_forward`` has transformers' attention-function signature (see
``transformers/integrations/sdpa_attention.py``): it finds the kernel attached to the calling
attention module (``module.kernel_attn``), turns transformers' arguments into the kernel contract
(2-D key-padding mask, causal flag, scaling) and returns ``([B, N, Hq, Dv], None)``. Under a
``RecurrentStateCache`` the cache layer's ``update`` puts itself into the module kwargs: ``linear_state``
(linear kernels: :meth:`RecurrentStateLayer.attend`) or ``window_cache`` (softmax with a window:
:meth:`WindowKVLayer.attend`, given the raw 2-D mask over past + new tokens); the layer then runs the kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import KERNELS, Kernel, add_kernel, is_softmax
from .transfer import active_probe, active_transfer, teacher_kernel

KERNEL_ATTR = "kernel_attn"
# Written as attn_implementation into a saved config.json: without the plugin imported, transformers
# refuses it and its error message names this string.
SAVED_NAME = "hf_kernel_attn(import hf_kernel_attn before loading)"
UNSUPPORTED_KWARGS = ("softcap", "s_aux")


def padding_mask(
    batch_size: int,
    q_length: int | None = None,  # transformers < 5.4 passes cache_position (in kwargs) instead
    kv_length: int = 0,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Registered mask function: the 2-D key-padding mask ``[B, kv_length]`` (True = real token), or
    None without padding. Kernels apply causality themselves, so memory stays O(N)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    # under torch.compile an all-ones mask is passed on as a mask (same numbers, no host sync)
    if mask.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return repr(value)


def _key_mask(attention_mask: Any, kv_length: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"hf_kernel_attn kernels take a 2-D key-padding mask [batch, keys]; got {shape}. "
            "Pass a 2-D attention_mask (custom 4-D masks are not supported)."
        )
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] != kv_length:
        raise ValueError(f"attention mask covers {mask.shape[1]} keys but there are {kv_length}")
    return mask


def _is_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    return bool(causal)


def packed_segments(position_ids: Any, attention_mask: Any, n: int) -> list[list[tuple[int, int]]] | None:
    """Packed rows (SFT-style: several documents in one row without padding, ``position_ids`` restarting at each,
    as TRL's flattening collator and flash-attention's varlen path use): per row the ``[start, end)`` of each
    document, or None when no row restarts. Read from the tensor, so skipped while compiling (a host sync)."""
    if torch.compiler.is_compiling() or attention_mask is not None or n <= 1:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != n:
        return None
    pos = position_ids.reshape(-1, n)
    restarts = pos[:, 1:] <= pos[:, :-1]
    if not bool(restarts.any()):
        return None
    segments = []
    for row in restarts:
        starts = [0, *(row.nonzero().flatten() + 1).tolist()]
        segments.append(list(zip(starts, [*starts[1:], n], strict=True)))
    return segments


def _per_document(kernel: Kernel, q, k, v, segments, causal: bool, scaling, dropout: float) -> torch.Tensor:
    """The kernel on each document of each packed row alone: no key, recurrent state or window crosses a
    boundary (flash-linear-attention's ``cu_seqlens`` contract), positions restart with each document."""
    if k.shape[-2] != q.shape[-2]:
        raise ValueError("packed rows (position_ids restarting inside a row) cannot follow cached tokens; "
                         "prefill packed rows without a cache (use_cache=False)")
    rows = []
    for b in range(q.shape[0]):
        docs = segments[b] if len(segments) > 1 else segments[0]
        pieces = [kernel(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], key_mask=None, causal=causal,
                         scaling=scaling, dropout=dropout) for s, e in docs]
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows, 0)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attached kernel in place of transformers' attention function. The positional order (module, query,
    key, value, attention_mask, dropout, scaling) is transformers' own (``sdpa_attention_forward``): wrappers
    that other libraries put around every registered function (kvpress does) pass ``dropout`` by position."""
    kernel: Kernel | None = getattr(module, KERNEL_ATTR, None)
    if kernel is None:
        raise ValueError(
            f"{type(module).__name__} has no kernel attached although the model's attn_implementation is an "
            "hf_kernel_attn kernel; call hf_kernel_attn.patch(model, kernel=...) first"
        )
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"hf_kernel_attn kernels do not implement {name!r} (got {_describe(kwargs[name])}); "
                             f"{type(module).__name__} needs it")
    native = kwargs.get("sliding_window")
    if native is not None and not getattr(getattr(teacher_kernel(kernel), "options", None), "window", 0):
        raise ValueError(
            f"{type(module).__name__} is a sliding-window layer (sliding_window={native}) but its kernel "
            f"{kernel.name!r} attends to the whole context; patch() keeps such layers as softmax(window={native}) "
            "unless the kernel is given a window of its own (window=W)")
    bias = kwargs.get("position_bias")
    if bias is not None and not teacher_kernel(kernel).supports_bias:
        able = sorted(n for n, c in KERNELS.items() if c.supports_bias)
        raise ValueError(f"kernel {kernel.name!r} cannot take the additive position bias of "
                         f"{type(module).__name__} ({_describe(bias)}): it has no logits to add it to; kernels that "
                         f"can: {able}")
    segments = packed_segments(kwargs.get("position_ids"), attention_mask, query.shape[-2])
    key_mask = _key_mask(attention_mask, key.shape[-2])
    causal = _is_causal(module, kwargs)
    dropout = dropout if module.training else 0.0
    kernel = teacher_kernel(kernel)
    probe = active_probe()
    if probe is not None:
        probe(kernel.shape.layer_idx, query.detach(), key.detach(), key_mask, causal, scaling, value=value.detach())
    recorder = active_transfer()
    if segments is not None:
        if recorder is not None or bias is not None or kwargs.get("linear_state") or kwargs.get("window_cache"):
            raise ValueError("packed rows (position_ids restarting inside a row) run plain forwards only: not under "
                             "attention transfer, with a position bias or with a recurrent/window cache; unpack them "
                             "into rows with an attention_mask, or pass use_cache=False")
        return _per_document(kernel, query, key, value, segments, causal, scaling, dropout), None
    if recorder is not None and not is_softmax(kernel.name):
        return recorder.step(kernel, query, key, value, key_mask=key_mask, causal=causal, scaling=scaling), None
    state_layer = kwargs.get("linear_state")
    if state_layer is not None and kernel.is_linear:
        return state_layer.attend(kernel, query, key, value, key_mask=key_mask, causal=causal, scaling=scaling), None
    window_layer = kwargs.get("window_cache")
    if window_layer is not None:
        # a windowed-softmax cache layer (cache.WindowKVLayer): key/value are the new chunk only; the layer adds
        # its sinks and recent keys and reads the new tokens' padding from the raw 2-D mask
        return window_layer.attend(kernel, query, key, value, attention_mask=attention_mask, causal=causal,
                                   scaling=scaling, dropout=dropout), None
    extra = {} if bias is None else {"bias": bias}
    return kernel(query, key, value, key_mask=key_mask, causal=causal, scaling=scaling, dropout=dropout,
                  **extra), None


def register() -> None:
    """Register every kernel name (and the saved-model marker) with both transformers interfaces."""
    for name in [*KERNELS, SAVED_NAME]:
        _register_name(name)


def _register_name(name: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


def register_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Add a kernel class to hf_kernel_attn (usable as a class decorator): its ``name`` then works everywhere a
    built-in kernel's does (``attn_implementation=``, ``patch``, ``from_pretrained``, training and evaluation
    configs, benchmarks). A checkpoint saved with it records ``cls.__module__``; loading it never imports that
    module on the checkpoint's word: the user imports it (``--import``, ``kernel_modules=``; docs/security.md)."""
    add_kernel(cls)
    _register_name(cls.name)
    return cls
