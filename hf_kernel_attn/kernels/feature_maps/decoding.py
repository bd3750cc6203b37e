"""The packed decode step of a window hybrid (:mod:`..linear.window_decode`): once the prompt is behind, one token
at a time on one key/value buffer. A mixin of :class:`.base.LinearKernel`."""

from __future__ import annotations

import torch

from ..linear import window_decode
from ..linear.state import LinearState


class PackedDecoding:
    """The packed decode step for :class:`.base.LinearKernel` (module docstring)."""

    @property
    def decodes_packed(self) -> bool:
        """Whether decode steps can run on the packed layout of :mod:`..linear.window_decode`: a window hybrid
        without a decay, with or without a sparse cache, and no exact heads that keep every key, evaluated by this
        class's forms (:attr:`packs_window_state`: a kernel with a state of its own, as the delta rule's, sets it
        False)."""
        exact_heads = bool(self.options.softmax_heads) and not self.options.sparse_cache
        return bool(self.window and not self.is_gated and not exact_heads and self.packs_window_state)

    def can_pack(self, state: LinearState | None, window_keys: torch.Tensor | None, position: int) -> bool:
        """Whether a general decode state after ``position`` real tokens can go to the packed layout."""
        return self.decodes_packed and window_decode.can_pack(
            state, window_keys, window=self.window, sinks=self.options.sinks, capacity=self.options.sparse_cache,
            position=position, block=self.options.sparse_block)

    def pack_decode_state(self, state: LinearState, window_keys: torch.Tensor | None,
                          window_values: torch.Tensor | None, position: int,
                          scaling: float | None = None) -> window_decode.PackedWindowState:
        """The packed layout of a general decode state (:meth:`can_pack`) after ``position`` tokens; ``scaling`` the
        attention's (φ of the cached keys is taken with it, as in :meth:`_windowed_sparse`)."""
        scaling = self.shape.head_dim ** -0.5 if scaling is None else scaling
        zero = torch.zeros(1, device=state.S.device, dtype=torch.long)

        def key_features(keys: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
            # positions None: the cache's pairs (a sparse cache needs a position-free map, as in _windowed_sparse)
            return self.feature_k(keys.contiguous(), zero.expand(keys.shape[-2]) if positions is None else positions,
                                  scaling)

        return window_decode.pack(state, window_keys, window_values, key_features, window=self.window,
                                  position=position)

    def fits_packed(self, packed: window_decode.PackedWindowState, q, k, v, key_mask) -> bool:
        """Whether this one-token call can take the packed step: no padding, no autograd, the options the state was
        packed under."""
        return (key_mask is None and q.shape[-2] == 1 and self.decodes_packed and not self.needs_grad(q, k, v, None)
                and packed.num_sinks == self.options.sinks and packed.ring == self.window - 1
                and packed.capacity == self.options.sparse_cache)

    def decode_packed(self, q, k, v, packed: window_decode.PackedWindowState, scaling=None) -> torch.Tensor:
        """One decode step on the packed state (:func:`..linear.window_decode.decode_step`, the same rule as
        :meth:`_windowed`): ``q`` ``[B, Hq, 1, D]``, ``k`` / ``v`` ``[B, Hkv, 1, ·]``; returns
        ``[B, 1, Hq, Dv]`` and advances ``packed``."""
        b, hq, _, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        scaling = d ** -0.5 if scaling is None else scaling
        heads = self.options.softmax_heads
        linear_part = not (self.linear_branch_off or len(set(heads)) == hq)
        log_mix = self._decode_log_mix(hkv, q.device) if linear_part else None

        self.check_positions(packed.position + 1)

        def feature_q(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.feature_q(x.contiguous(), positions, scaling)

        out = window_decode.decode_step(packed, q.reshape(b, hkv, hq // hkv, d), k, v, feature_q,
                                        self.hybrid_spec(scaling), log_mix, linear_part)
        return out.reshape(b, 1, hq, dv).to(q.dtype)

    def _decode_log_mix(self, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        """ln λ ``[Hkv, G]`` of the feature-map part (-inf in ``softmax_heads``), or None (λ = 1): worked out again
        only when ``window_log_mix`` changed (in place: its version counter; replaced: its storage or dtype) or the
        device did."""
        param = getattr(self, "window_log_mix", None)
        key = (None if param is None else (param._version, param.data_ptr(), param.dtype), device,
               self.linear_branch_off)
        memo = getattr(self, "_mix_memo", None)
        if memo is not None and memo[0] == key and (param is None or memo[2] is param):
            return memo[1]
        log_mix = self.branch_log_mix(num_kv_heads, device)
        if self.options.sparse_cache:
            log_mix = self._budgeted_heads_off(log_mix, num_kv_heads, device)
        log_mix = None if log_mix is None else log_mix.detach()
        self._mix_memo = (key, log_mix, param)
        return log_mix
