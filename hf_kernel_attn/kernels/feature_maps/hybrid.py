"""The sliding-window hybrid of a feature-map kernel: softmax over the last W keys (and the ``sinks``), the feature
map over older ones (:mod:`..linear.window`), with a bounded sparse cache (:mod:`..linear.sparse_cache`) and exact
softmax heads (``softmax_heads``). A mixin of :class:`.base.LinearKernel`."""

from __future__ import annotations

import dataclasses

import torch

from .. import linear
from ..base import accum, group_queries, ungroup_output, visibility_mask
from ..linear.gated import gated_hybrid
from ..linear.sparse_cache import sparse_window
from ..linear.spec import HybridCall, HybridInputs, HybridSpec
from ..linear.window import hybrid_attention, update_sinks
from .options import AttentionCall, dense


class WindowHybrid:
    """The window hybrid, its sparse cache and exact heads for :class:`.base.LinearKernel` (module docstring)."""

    def _windowed(self, q, k, v, call: AttentionCall):
        """The sliding-window hybrid (:func:`..linear.window.hybrid_attention`); the state (causal) holds the keys
        before ``k``, and the one returned holds every key but the last W - 1."""
        key_mask, causal, scaling, state, offset = call.key_mask, call.causal, call.scaling, call.state, call.offset
        hkv = k.shape[1]
        # a decode step (one query after a state, m ≤ W keys): only the keys leaving the window (the first
        # m - W + 1) are folded into the state; the window's keys are attended with softmax and their φ never read
        decode = causal and state is not None and q.shape[-2] == 1 and k.shape[-2] <= self.window and not self.is_gated
        leaving = max(0, k.shape[-2] - self.window + 1) if decode else None
        fq, fk = self.features(q, k, scaling, offset, key_rows=leaving)
        log_mix = self.branch_log_mix(hkv, k.device)
        sinks = None
        if self.options.sinks:
            sinks = update_sinks(k, v, key_mask, self.options.sinks, offset, None if state is None else state.sinks)
        spec = self.hybrid_spec(scaling)
        x = HybridInputs(group_queries(q, hkv), k, v, fq, fk)
        form = HybridCall(causal=causal, key_mask=key_mask, state=state, offset=offset, log_mix=log_mix, sinks=sinks,
                          need_state=call.need_state and causal, blocked=not self.needs_grad(q, k, v, state))
        if self.options.sparse_cache:
            return self._windowed_sparse(x, spec, form)
        if self.is_gated:
            out, new_state = gated_hybrid(x, self.gates(k, scaling), spec, form)
            out = ungroup_output(out).to(q.dtype)
        else:
            out, new_state = hybrid_attention(x, spec, form)
        if new_state is not None and sinks is not None:
            new_state = linear.LinearState(new_state.S, new_state.z, sinks)
        return out, new_state

    def _windowed_sparse(self, x: HybridInputs, spec: HybridSpec, call: HybridCall):
        """The hybrid with its bounded sparse cache (:func:`..linear.sparse_cache.sparse_window`): the plain hybrid's
        sums from a state without the cache, corrected for the pairs the cache holds."""
        if not call.causal:
            raise ValueError(f"{self.name}: sparse_cache is causal only (the cache holds pairs that left a causal "
                             "window); use sparse_cache=0 for bidirectional attention")
        hkv, dv = x.k.shape[1], x.v.shape[-1]
        call = dataclasses.replace(call, log_mix=self._budgeted_heads_off(call.log_mix, hkv, x.q.device))
        raw, top = hybrid_attention(x, spec, dataclasses.replace(call, raw=True))
        zero = torch.zeros(1, device=x.k.device, dtype=torch.long)

        def key_features(keys: torch.Tensor) -> torch.Tensor:
            return self.feature_k(dense(keys), zero.expand(keys.shape[-2]), spec.scaling).to(raw.dtype)

        out, s, cache = sparse_window(raw, top, x, key_features, spec, call)
        return (ungroup_output(out).to(x.q.dtype),
                linear.LinearState(s[..., :dv], s[..., dv], call.sinks, sparse=cache))

    def hybrid_spec(self, scaling: float) -> HybridSpec:
        """The window hybrid this kernel's options define, at the softmax scale ``scaling``, as the forms take it."""
        opts = self.options
        return HybridSpec(window=opts.window, scaling=scaling, chunk_size=opts.chunk_size, sinks=opts.sinks,
                          capacity=opts.sparse_cache, block=opts.sparse_block, eps=opts.eps)

    def _budgeted_heads_off(self, log_mix: torch.Tensor | None, num_kv_heads: int,
                            device: torch.device) -> torch.Tensor | None:
        """ln λ ``[Hkv, G]`` with -inf in the ``softmax_heads``: with a sparse cache they are retrieval heads on a
        budget (no linear part; the window, sinks and cached pairs alone)."""
        heads = self.options.softmax_heads
        if not heads:
            return log_mix
        off = torch.zeros(self.shape.num_heads, device=device)
        off[heads] = float("-inf")
        off = off.view(num_kv_heads, -1)
        return off if log_mix is None else log_mix + off

    def branch_log_mix(self, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        """ln λ ``[Hkv, G]`` of the windowed hybrid's feature-map part: the learnable factor (``window_mix``),
        -inf everywhere while :attr:`linear_branch_off` is set (the window alone), else None (λ = 1)."""
        log_mix = getattr(self, "window_log_mix", None)
        if log_mix is not None:
            log_mix = log_mix.view(num_kv_heads, -1)
        if self.linear_branch_off:
            shape = (num_kv_heads, self.shape.num_heads // num_kv_heads)
            off = torch.full(shape, float("-inf"), device=device)
            log_mix = off if log_mix is None else log_mix + off
        return log_mix

    def _exact_heads(self, q, k, v, call: AttentionCall, out, new_state):
        """Overwrite the ``softmax_heads`` of ``out`` ``[B, N, Hq, Dv]`` with exact softmax over every key seen
        (the kept K/V of earlier calls, then these)."""
        key_mask, causal, scaling, state, offset = call.key_mask, call.causal, call.scaling, call.state, call.offset
        heads = self.options.softmax_heads
        g = q.shape[1] // k.shape[1]
        kv_heads = sorted({h // g for h in heads})
        b, m = k.shape[0], k.shape[-2]
        real = torch.ones(b, m, dtype=torch.bool, device=k.device) if key_mask is None else key_mask.to(torch.bool)
        keys, values = k[:, kv_heads], v[:, kv_heads]
        previous = None if state is None else state.exact
        if previous is not None:
            new_from = min(m, max(0, previous.keys.shape[-2] - offset))  # the first key not kept yet
            keys = torch.cat([previous.keys, keys[:, :, new_from:].to(previous.keys.dtype)], -2)
            values = torch.cat([previous.values, values[:, :, new_from:].to(previous.values.dtype)], -2)
            real = torch.cat([previous.real, real[:, new_from:]], -1)
        elif causal and (offset or state is not None):
            raise ValueError(f"{self.name}: softmax_heads={heads} need every earlier key, but the state holds none; "
                             "decode with the cache the kernel's own forward returned")
        slot = {kv: i for i, kv in enumerate(kv_heads)}
        pick = [slot[h // g] for h in heads]
        n, total = q.shape[-2], keys.shape[-2]
        mask = visibility_mask(None if key_mask is None and previous is None else real, n, total, causal, q.device)
        exact = torch.nn.functional.scaled_dot_product_attention(
            accum(q[:, heads]), accum(keys[:, pick]), accum(values[:, pick]), attn_mask=mask, scale=scaling)
        index = torch.tensor(heads, device=out.device)
        out = out.index_copy(2, index, exact.transpose(1, 2).to(out.dtype))
        if new_state is None:  # no state asked for (or bidirectional)
            return out, None
        return out, dataclasses.replace(new_state, exact=linear.ExactKV(keys, values, real))
