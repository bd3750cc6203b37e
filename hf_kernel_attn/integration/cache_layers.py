"""The cache layer of a linear-kernel layer: :class:`RecurrentStateLayer` keeps only the recurrent state
S = Σ φ(k)vᵀ and z = Σ φ(k) per KV head (and, for sliding-window hybrids, the last W - 1 keys/values), never the
whole K/V; between decode steps a window hybrid's state may sit in the packed layout of
``kernels/linear/window_decode.py``. The shared helpers of the cache layers (:func:`tensor_bytes`,
:func:`enter_module_kwargs`) live here too; :mod:`.cache` assembles the layers into a ``Cache``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ..kernels import LinearKernel
from ..kernels.linear.state import LinearState, PastKeys
from ..kernels.linear.window_decode import PackedWindowState, unpack


def query_count(query: int | torch.Tensor) -> int:
    """The new tokens a cache layer's ``get_mask_sizes`` is asked about: their count (transformers from 5.4) or
    their positions, ``cache_position`` (before 5.4)."""
    return int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Σ numel · element size over ``tensors``: the bytes they hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


def enter_module_kwargs(layer: DynamicLayer, key_states: torch.Tensor, update_kwargs: dict[str, Any],
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
        enter_module_kwargs(self, key_states, kwargs, "linear_state")
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
        out, self._state = kernel.forward_with_state(q, k, v, key_mask=key_mask, causal=True, scaling=scaling,
                                                     past=PastKeys(self._state, self._chunk_offset))
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

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        # the whole 2-D padding mask, as a DynamicLayer's: each layer slices the keys it sees (the new chunk,
        # or the window plus the new chunk), and softmax layers of a hybrid model see every key
        return self.cumulative_length + query_count(query), 0

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
            return tensor_bytes(*self._packed.tensors())
        total = 0 if self.state is None else tensor_bytes(self.state.S, self.state.z)
        if self.state is not None and self.state.sinks is not None:
            total += tensor_bytes(*self.state.sinks.tensors())
        if self.state is not None and self.state.sparse is not None:  # fixed slots: constant too
            total += tensor_bytes(*self.state.sparse.tensors())
        if self.state is not None and self.state.exact is not None:  # grows with the context
            total += tensor_bytes(*self.state.exact.tensors())
        if self.window_keys is not None:
            total += tensor_bytes(self.window_keys, self.window_values)
        return total
