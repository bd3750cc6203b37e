"""RecurrentStateCache: constant-memory decoding for linear-kernel layers.

A transformers ``Cache`` whose layers are either a :class:`RecurrentStateLayer` (linear kernels: keeps
only S = Σ φ(k)vᵀ and z = Σ φ(k) per KV head, never the whole K/V; sliding-window hybrids also keep the
last W - 1 keys/values) or a plain ``DynamicLayer`` (softmax-like
kernels in a hybrid model). ``generate`` on a patched model builds one automatically.

Flow per attention layer (transformers 5.x): the module calls ``cache.update(k, v, layer_idx, kwargs=kw)``
before the attention function; the state layer records the chunk, puts itself into ``kw`` as
``linear_state`` and returns the chunk unchanged; the attention function then calls
:meth:`RecurrentStateLayer.attend`, which runs the chunked causal form from the stored state (prefill)
or one O(F·Dv) update (a decode step) and keeps the final state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..kernels import LinearKernel
from ..kernels.linear import LinearState
from .attention import KERNEL_ATTR


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class RecurrentStateLayer(DynamicLayer):
    """One linear-kernel layer's recurrent state (fp32, or fp64 for fp64 inputs; on the keys' device)."""

    is_croppable = False
    is_compileable = False
    is_sliding = False

    def __init__(self, window: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: LinearState | None = None
        self.cumulative_length = 0
        self._chunk_offset = 0
        # sliding-window hybrids: the last W - 1 keys/values (the window of the next token, besides itself);
        # every older key lives in the state
        self.window = window
        self.window_keys: torch.Tensor | None = None
        self.window_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        module_kwargs = kwargs.get("kwargs")
        if not isinstance(module_kwargs, dict):
            raise RuntimeError(
                "RecurrentStateCache needs the attention module to pass its kwargs to cache.update(..., kwargs=...) "
                "(transformers >= 5.24 models do); this model does not"
            )
        module_kwargs["linear_state"] = self
        self._chunk_offset = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
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
        out, self.state = kernel.forward_with_state(
            q, k, v, key_mask=key_mask, causal=True, scaling=scaling, state=self.state, offset=self._chunk_offset
        )
        if self.window:
            keep = min(k.shape[-2], self.window - 1)
            # copies, so that the prefill's whole K/V is not kept alive through a view
            self.window_keys = k[:, :, k.shape[-2] - keep:].clone()
            self.window_values = v[:, :, v.shape[-2] - keep:].clone()
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
        self.state = None
        self.window_keys = self.window_values = None
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
        if self.state is not None:
            self.state = LinearState(fn(self.state.S), fn(self.state.z))
        if self.window_keys is not None:
            self.window_keys, self.window_values = fn(self.window_keys), fn(self.window_values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices])

    def nbytes(self) -> int:
        """The state plus the window's K/V (at most W - 1 positions): constant in the context length."""
        total = 0 if self.state is None else _bytes(self.state.S, self.state.z)
        if self.window_keys is not None:
            total += _bytes(self.window_keys, self.window_values)
        return total


class RecurrentStateCache(Cache):
    """Per layer: a recurrent state for linear kernels, a growing K/V cache for the others."""

    def __init__(self, model: torch.nn.Module) -> None:
        from .patching import attention_modules

        kernels = [getattr(m, KERNEL_ATTR, None) for m in attention_modules(model)]
        if not any(isinstance(k, LinearKernel) for k in kernels):
            raise ValueError("RecurrentStateCache needs a model patched with at least one linear kernel")
        super().__init__(layers=[RecurrentStateLayer(window=k.window) if isinstance(k, LinearKernel) else DynamicLayer()
                                 for k in kernels])

    def nbytes(self) -> int:
        """Bytes held by the cache: recurrent states plus any K/V of softmax-like layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentStateLayer):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                total += _bytes(layer.keys, layer.values)
        return total


def wants_state_cache(model: torch.nn.Module) -> bool:
    from .patching import attention_modules

    data = getattr(getattr(model, "config", None), "kernel_attention", None)
    return bool(data) and any(isinstance(getattr(m, KERNEL_ATTR, None), LinearKernel) for m in attention_modules(model))
