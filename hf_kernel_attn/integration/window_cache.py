"""The cache layer of a windowed-softmax layer (softmax with ``window`` W > 0): :class:`WindowKVLayer` keeps the S
sink keys/values and the last W - 1, each with its index position and real flag, so its memory is constant in the
context; :mod:`.cache` assembles the layers into a ``Cache``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ..kernels import Kernel
from ..kernels.retention import RetentionBudget, RetentionState
from ..kernels.slots import gather_keys, grow_slots, sink_slot_count, sink_slots
from ..kernels.softmax import SinkKeys, SoftmaxKernel, WindowBand, banded_attention
from .cache_layers import enter_module_kwargs, query_count, tensor_bytes


def has_retention_slots(kernel: Kernel | None) -> bool:
    """A softmax kernel with retention slots (option ``slots`` > 0): decodes with a :class:`RetentionKVLayer`."""
    return isinstance(kernel, SoftmaxKernel) and kernel.slots > 0


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
        enter_module_kwargs(self, key_states, kwargs, "window_cache")
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
        sinks = None
        if self.sinks:
            sinks = SinkKeys(self.sink_keys, self.sink_values, self.sink_pos, self.sink_valid)
        if start == 0 and keys.shape[-2] == n:
            # the first chunk (a prefill): the kernel's own forward, so a caching forward = a plain one
            out = kernel(q, k, v, key_mask=None if bool(real.all()) else real, causal=True, scaling=scaling,
                         dropout=dropout)
        else:
            band = WindowBand(self.window, scale, causal=True, q_start=start, k_start=start + n - keys.shape[-2],
                              dropout=dropout)
            out = banded_attention(q, keys, values, band, key_real=None if bool(real.all()) else real, sinks=sinks)
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

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        # the whole 2-D padding mask, as a DynamicLayer's (attend() reads the new chunk's columns)
        return self.cumulative_length + query_count(query), 0

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
        return tensor_bytes(*(t for t in (getattr(self, name) for name in self._TENSORS) if t is not None))


class RetentionKVLayer(DynamicLayer):
    """One layer of softmax with retention slots: the sinks, the keys not decided yet (the window and at most B that
    left it since the last boundary) and the C slots (:class:`~hf_kernel_attn.kernels.retention.RetentionState`),
    so memory is constant in the context. Prefill and decoding run the kernel's one rule, so a cached generation
    equals recomputation."""

    is_croppable = False
    is_compileable = False
    is_sliding = False

    def __init__(self, budget: RetentionBudget, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget = budget
        self._clear()

    def _clear(self) -> None:
        self.cumulative_length = 0
        self.state: RetentionState | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        enter_module_kwargs(self, key_states, kwargs, "window_cache")
        self.cumulative_length += key_states.shape[-2]
        return key_states, value_states  # the kept keys are added in attend()

    def attend(self, kernel: Kernel, q, k, v, *, attention_mask, causal: bool, scaling: float | None,
               dropout: float = 0.0) -> torch.Tensor:
        """Attention of the new chunk over the sinks, the slots and the window; the state moves past it."""
        if not causal:
            raise ValueError("RecurrentStateCache is for causal decoding; bidirectional layers take no cache")
        if not has_retention_slots(kernel) or kernel.options.budget() != self.budget:
            raise ValueError(f"this cache layer was built for softmax with {self.budget}, but the layer's kernel is "
                             f"{getattr(kernel, 'options', kernel)}; build a new cache after changing the kernel")
        n = k.shape[-2]
        real = None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[1] < n:
                raise ValueError("RetentionKVLayer needs the 2-D padding mask covering at least the new tokens")
            real = attention_mask[:, -n:].to(device=k.device, dtype=torch.bool)
            if bool(real.all()):
                real = None
        out, self.state = kernel.retention_step(q, k, v, key_real=real, scaling=scaling, state=self.state)
        return out

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        return self.cumulative_length + query_count(query), 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("a retention cache cannot be cropped (evicted keys are gone), so assisted/speculative "
                             "decoding is not supported with softmax slots; use greedy, sampling or beam search")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.map(lambda t: t[indices])

    def nbytes(self) -> int:
        """Sinks, undecided keys and slots with their positions, ln β and flags: constant in the context."""
        return 0 if self.state is None else tensor_bytes(*self.state.tensors())
