"""RecurrentStateCache: constant-memory decoding for linear-kernel and windowed-softmax layers.

A transformers ``Cache`` whose layers are a :class:`RecurrentStateLayer` (linear kernels: keeps
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
from ..kernels.linear.state import LinearState
from ..kernels.linear.window_decode import PackedWindowState, unpack
from ..kernels.softmax import SoftmaxKernel, banded_attention, gather_keys, grow_slots, sink_slot_count, sink_slots
from .attention import KERNEL_ATTR, packed_segments
from .modules import attention_modules


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _enter_module_kwargs(layer: DynamicLayer, key_states: torch.Tensor, update_kwargs: dict[str, Any],
                         name: str) -> None:
    """Initialise ``layer`` on first use and put it into the attention module's kwargs under ``name``, where
    the attention function finds it."""
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, key_states)
    module_kwargs = update_kwargs.get("kwargs")
    if not isinstance(module_kwargs, dict):
        raise RuntimeError(
            "RecurrentStateCache needs the attention module to pass its kwargs to cache.update(..., kwargs=...) "
            "(transformers >= 5.24 models do); this model does not"
        )
    module_kwargs[name] = layer


class _GeneralLayout:
    """An attribute of :class:`RecurrentStateLayer` in the general layout (stored under ``name``): reading or writing
    it first unpacks a packed state."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, layer: RecurrentStateLayer | None, owner: type) -> Any:
        if layer is None:
            return self
        layer._unpack()
        return getattr(layer, self.name)

    def __set__(self, layer: RecurrentStateLayer, value: Any) -> None:
        layer._unpack()
        setattr(layer, self.name, value)


class RecurrentStateLayer(DynamicLayer):
    """One linear-kernel layer's recurrent state (fp32, or fp64 for fp64 inputs; on the keys' device)."""

    is_croppable = False
    is_compileable = False
    is_sliding = False

    def __init__(self, window: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._state: LinearState | None = None
        self.cumulative_length = 0
        self._chunk_offset = 0
        # sliding-window hybrids: the last W - 1 keys/values (the window of the next token, besides itself);
        # every older key lives in the state
        self.window = window
        self._window_keys: torch.Tensor | None = None
        self._window_values: torch.Tensor | None = None
        # window hybrids between decode steps: the same tensors in the packed layout
        # (kernels/linear/window_decode.py), taken once the prompt is behind; reading ``state`` or the window keys
        # gives the general layout back
        self._packed: PackedWindowState | None = None
        self._all_real = True  # no key so far was padding (a condition of the packed layout)

    def _unpack(self) -> None:
        if self._packed is not None:
            self._state, self._window_keys, self._window_values = unpack(self._packed)
            self._packed = None

    # the general layout, as readers and the synthetic-cache writer expect it (a packed state is unpacked first)
    state = _GeneralLayout("_state")
    window_keys = _GeneralLayout("_window_keys")
    window_values = _GeneralLayout("_window_values")

    @property
    def is_packed(self) -> bool:
        """Whether the state is in the packed layout now (decode steps take the packed step)."""
        return self._packed is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        _enter_module_kwargs(self, key_states, kwargs, "linear_state")
        self._chunk_offset = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        if self._packed is not None:
            if key_states.shape[-2] == 1:
                return key_states, value_states  # attend() takes the packed step, or puts the window back in front
            self._unpack()
        if self.window and self.window_keys is not None:
            # the kernel sees the cached window first: keys at positions offset - (W - 1) ...
            self._chunk_offset -= self.window_keys.shape[-2]
            return (torch.cat([self.window_keys, key_states], -2), torch.cat([self.window_values, value_states], -2))
        return key_states, value_states

    def attend(self, kernel: LinearKernel, q, k, v, *, key_mask, causal: bool, scaling: float | None) -> torch.Tensor:
        if not causal:
            raise ValueError("RecurrentStateCache is for causal decoding; bidirectional layers take no cache")
        if kernel.window != self.window:
            raise ValueError(f"this cache layer was built for window {self.window}, but its kernel has window "
                             f"{kernel.window}; build a new cache after changing the kernel")
        if self._packed is not None:  # one new token after a packed state (update() added no window keys)
            if kernel.fits_packed(self._packed, q, k, v, key_mask):
                return kernel.decode_packed(q, k, v, self._packed, scaling)
            self._unpack()
            if self._window_keys is not None:
                ring = self._window_keys.shape[-2]
                k = torch.cat([self._window_keys, k.to(self._window_keys.dtype)], -2)
                v = torch.cat([self._window_values, v.to(self._window_values.dtype)], -2)
                self._chunk_offset -= ring
                if key_mask is not None:  # the window's keys were real (a condition of packing)
                    key_mask = torch.cat([key_mask.new_ones(key_mask.shape[0], ring), key_mask], -1)
        out, self._state = kernel.forward_with_state(
            q, k, v, key_mask=key_mask, causal=True, scaling=scaling, state=self._state, offset=self._chunk_offset
        )
        if key_mask is not None and not bool(key_mask.all()):
            self._all_real = False
        if self.window:
            keep = min(k.shape[-2], self.window - 1)
            # copies, so that the prefill's whole K/V is not kept alive through a view
            self._window_keys = k[:, :, k.shape[-2] - keep:].clone()
            self._window_values = v[:, :, v.shape[-2] - keep:].clone()
        if (self._all_real and not torch.is_grad_enabled()
                and kernel.can_pack(self._state, self._window_keys, self.cumulative_length)):
            self._packed = kernel.pack_decode_state(self._state, self._window_keys, self._window_values,
                                                    self.cumulative_length, scaling)
            self._state = self._window_keys = self._window_values = None
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the whole 2-D padding mask, as a DynamicLayer's: each layer slices the keys it sees (the new chunk,
        # or the window plus the new chunk), and softmax layers of a hybrid model see every key
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._packed = None
        self._state = None
        self._window_keys = self._window_values = None
        self._all_real = True
        self.cumulative_length = 0
        self._chunk_offset = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(
                "a recurrent linear-attention state cannot be cropped (it is a running sum that cannot be rewound), "
                "so assisted/speculative decoding and other cache-cropping strategies are not supported with "
                "hf_kernel_attn linear kernels; use plain greedy, sampling or beam search"
            )

    def _map_state(self, fn) -> None:
        if self._packed is not None:
            self._packed = self._packed.map(fn)
            return
        if self.state is not None:
            sinks = None if self.state.sinks is None else self.state.sinks.map(fn)
            exact = None if self.state.exact is None else self.state.exact.map(fn)
            sparse = None if self.state.sparse is None else self.state.sparse.map(fn)
            self.state = LinearState(fn(self.state.S), fn(self.state.z), sinks, exact, sparse)
        if self.window_keys is not None:
            self.window_keys, self.window_values = fn(self.window_keys), fn(self.window_values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices])

    def nbytes(self) -> int:
        """The state plus the window's K/V (at most W - 1 positions), the sinks and a sparse cache's slots: constant in
        the context; plus, with ``softmax_heads``, every key/value of their KV heads. The packed layout holds the same
        tensors."""
        if self._packed is not None:
            return _bytes(*self._packed.tensors())
        total = 0 if self.state is None else _bytes(self.state.S, self.state.z)
        if self.state is not None and self.state.sinks is not None:
            total += _bytes(*self.state.sinks.tensors())
        if self.state is not None and self.state.sparse is not None:  # fixed slots: constant too
            total += _bytes(*self.state.sparse.tensors())
        if self.state is not None and self.state.exact is not None:  # grows with the context
            total += _bytes(*self.state.exact.tensors())
        if self.window_keys is not None:
            total += _bytes(self.window_keys, self.window_values)
        return total


def is_windowed_softmax(kernel: Kernel | None) -> bool:
    """A softmax kernel with a sliding window (option ``window`` > 0): decodes with a :class:`WindowKVLayer`."""
    return isinstance(kernel, SoftmaxKernel) and kernel.window > 0


class WindowKVLayer(DynamicLayer):
    """One windowed-softmax layer's bounded K/V: the sinks (the first S real tokens of each row) and the last
    W - 1 keys/values, each with its index position and real flag, so memory is constant in the context.

    A chunk of N queries at index positions T … T + N - 1 attends to [sinks, recent, new] with the mask
    (k_pos ≤ q_pos) & ((q_pos - k_pos < W) | is_sink) & real; a sink still inside the window is counted once
    (through the recent keys). Index positions count padding too, as the kernel's positions do without a cache.
    """

    is_croppable = False
    is_compileable = False
    is_sliding = False

    def __init__(self, window: int, sinks: int = 0, **kwargs: Any) -> None:
        if window < 1:
            raise ValueError(f"WindowKVLayer needs a window >= 1, got {window!r}")
        super().__init__(**kwargs)
        self.window = window
        self.sinks = sinks
        self._clear()

    def _clear(self) -> None:
        self.cumulative_length = 0
        self._chunk_start = 0
        self.recent_keys: torch.Tensor | None = None  # [B, Hkv, ≤ W - 1, D] at positions cumulative - len …
        self.recent_values: torch.Tensor | None = None
        self.recent_real: torch.Tensor | None = None  # [B, ≤ W - 1] bool
        self.sink_keys: torch.Tensor | None = None  # [B, Hkv, S, D]
        self.sink_values: torch.Tensor | None = None
        self.sink_pos: torch.Tensor | None = None  # [B, S] index positions
        self.sink_valid: torch.Tensor | None = None  # [B, S] bool: slot filled
        self.real_seen: torch.Tensor | None = None  # [B] real tokens seen so far (ranks of the next sinks)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        _enter_module_kwargs(self, key_states, kwargs, "window_cache")
        self._chunk_start = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        return key_states, value_states  # the kept keys are added in attend()

    def attend(self, kernel: Kernel, q, k, v, *, attention_mask, causal: bool, scaling: float | None,
               dropout: float = 0.0) -> torch.Tensor:
        """Attention of the new chunk (``k``/``v`` as returned by :meth:`update`) over [sinks, recent, new];
        ``attention_mask``: the 2-D padding mask whose last N columns are the new tokens' (None = all real)."""
        if not causal:
            raise ValueError("RecurrentStateCache is for causal decoding; bidirectional layers take no cache")
        if not is_windowed_softmax(kernel) or (kernel.window, kernel.sinks) != (self.window, self.sinks):
            got = (f"softmax with window {kernel.window} and sinks {kernel.sinks}" if isinstance(kernel, SoftmaxKernel)
                   else f"kernel {getattr(kernel, 'name', kernel)!r}")
            raise ValueError(f"this cache layer was built for softmax with window {self.window} and sinks "
                             f"{self.sinks}, but its kernel is {got}; build a new cache after changing the kernel")
        b, n = k.shape[0], k.shape[-2]
        if q.shape[-2] != n:
            raise ValueError(f"WindowKVLayer got {q.shape[-2]} queries for {n} new keys")
        if attention_mask is None:
            new_real = torch.ones(b, n, dtype=torch.bool, device=k.device)
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[1] < n:
                raise ValueError("WindowKVLayer needs the 2-D padding mask covering at least the new tokens")
            new_real = attention_mask[:, -n:].to(device=k.device, dtype=torch.bool)
        start = self._chunk_start
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        if self.sinks:
            self._add_sinks(k, v, new_real, start)
        if self.recent_keys is not None and self.recent_keys.shape[-2]:
            keys = torch.cat([self.recent_keys, k], -2)
            values = torch.cat([self.recent_values, v], -2)
            real = torch.cat([self.recent_real, new_real], -1)
        else:
            keys, values, real = k, v, new_real
        sink_args = {}
        if self.sinks:
            sink_args = dict(sink_k=self.sink_keys, sink_v=self.sink_values, sink_pos=self.sink_pos,
                             sink_valid=self.sink_valid)
        if start == 0 and keys.shape[-2] == n:
            # the first chunk (a prefill): the kernel's own forward, so a caching forward = a plain one
            out = kernel(q, k, v, key_mask=None if bool(real.all()) else real, causal=True, scaling=scaling,
                         dropout=dropout)
        else:
            out = banded_attention(q, keys, values, window=self.window, scale=scale, causal=True, q_start=start,
                                   k_start=start + n - keys.shape[-2], key_real=None if bool(real.all()) else real,
                                   dropout=dropout, **sink_args)
        keep = min(keys.shape[-2], self.window - 1)
        cut = keys.shape[-2] - keep
        # copies, so that the prefill's whole K/V is not kept alive through a view
        self.recent_keys, self.recent_values = keys[:, :, cut:].clone(), values[:, :, cut:].clone()
        self.recent_real = real[:, cut:].clone()
        return out

    def _add_sinks(self, k: torch.Tensor, v: torch.Tensor, new_real: torch.Tensor, start: int) -> None:
        """Fill the sink slots whose rank (among each row's real tokens) falls in the new chunk."""
        b, h, _, d = k.shape
        slots = sink_slot_count(self.sinks, start + k.shape[-2])  # grown with the tokens seen, at most S
        if self.sink_keys is None:
            self.sink_keys = k.new_zeros(b, h, slots, d)
            self.sink_values = v.new_zeros(b, h, slots, v.shape[-1])
            self.sink_pos = torch.zeros(b, slots, dtype=torch.long, device=k.device)
            self.sink_valid = torch.zeros(b, slots, dtype=torch.bool, device=k.device)
            self.real_seen = torch.zeros(b, dtype=torch.long, device=k.device)
        elif self.sink_keys.shape[-2] < slots:
            self.sink_keys = grow_slots(self.sink_keys, 2, slots)
            self.sink_values = grow_slots(self.sink_values, 2, slots)
            self.sink_pos = grow_slots(self.sink_pos, 1, slots)
            self.sink_valid = grow_slots(self.sink_valid, 1, slots, False)
        idx, pos, fresh = sink_slots(new_real, self.sink_keys.shape[-2], offset=start, seen=self.real_seen)
        if bool(fresh.any()):
            sel = fresh[:, None, :, None]
            self.sink_keys = torch.where(sel, gather_keys(k, idx).to(self.sink_keys.dtype), self.sink_keys)
            self.sink_values = torch.where(sel, gather_keys(v, idx).to(self.sink_values.dtype), self.sink_values)
            self.sink_pos = torch.where(fresh, pos, self.sink_pos)
            self.sink_valid = self.sink_valid | fresh
        self.real_seen = self.real_seen + new_real.long().sum(-1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the whole 2-D padding mask, as a DynamicLayer's (attend() reads the new chunk's columns)
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(
                "a sliding-window softmax cache cannot be cropped (the keys that left the window are gone, so it "
                "cannot be rewound), so assisted/speculative decoding and other cache-cropping strategies are not "
                "supported with a windowed softmax kernel; use plain greedy, sampling or beam search"
            )

    def offload(self) -> None:  # small and constant: stays on its device
        pass

    def prefetch(self) -> None:
        pass

    _TENSORS = ("recent_keys", "recent_values", "recent_real", "sink_keys", "sink_values", "sink_pos", "sink_valid",
                "real_seen")

    def _map_state(self, fn) -> None:
        for name in self._TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices])

    def nbytes(self) -> int:
        """The sinks and the last W - 1 keys/values with their positions and flags: constant in the context."""
        return _bytes(*(t for t in (getattr(self, name) for name in self._TENSORS) if t is not None))


def _cache_layer(kernel: Kernel | None):
    if isinstance(kernel, LinearKernel):
        return RecurrentStateLayer(window=kernel.window)
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
            if isinstance(layer, (RecurrentStateLayer, WindowKVLayer)):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                total += _bytes(layer.keys, layer.values)
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
