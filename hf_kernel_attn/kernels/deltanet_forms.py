"""The evaluation orders of the delta-rule kernels (:mod:`.deltanet`): causal (the chunked WY form, a block of chunks
at a time without autograd; the recurrent step for a few new tokens) and the sliding-window hybrid (softmax over
the window and sinks plus the read-out of the memory after key i - W, decayed to i):

    out_i = softmax_{j ∈ win(i) ∪ sinks}(s q_i·k_j) v_j  +  λ_h e^{b_i - b_{i-W}} S_{i-W} q̂_i

A mixin of :class:`.deltanet.DeltaNetKernel`, which holds q̂, k̂, β and α and picks between them
(:meth:`.deltanet.DeltaNetKernel.feature_map_forward`).
"""

from __future__ import annotations

import torch

from . import linear
from .base import accum, group_queries, ungroup_output
from .delta_rule import delta_rule_chunk, delta_rule_recurrent
from .feature_maps.options import dense
from .linear import cost
from .linear.gated import softmax_band
from .linear.spec import HybridCall, HybridSpec
from .linear.window import update_sinks

RECURRENT_BELOW = 8  # new tokens up to this many (decoding): the recurrent step instead of the chunked form


class DeltaRuleForms:
    """The forms of :class:`.deltanet.DeltaNetKernel` (module docstring)."""

    def _run(self, qn, kn, vv, beta, log_alpha, s):
        """The recurrent step for a few tokens (decoding), the chunked form otherwise."""
        if kn.shape[-2] <= RECURRENT_BELOW:
            return delta_rule_recurrent(qn, kn, vv, beta, log_alpha, s)
        return delta_rule_chunk(qn, kn, vv, beta, log_alpha, s, self.options.chunk_size)

    @staticmethod
    def _state(s: torch.Tensor) -> linear.LinearState:
        """The memory as the cache holds it: S ``[B, Hkv, D, Dv]`` (z unused: no normaliser)."""
        return linear.LinearState(s, s.new_zeros(*s.shape[:2], 0))

    def _delta_causal(self, q, k, v, key_mask, scaling, state, offset):
        """Causal, no window: keys before the queries folded into the memory, then the queries' chunks; without
        autograd a block of whole chunks at a time, every temporary the size of a block."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        self.check_positions(offset + m)
        s = None if state is None else state.S.to(accum(q).dtype)
        prefix = m - n
        mask = None if key_mask is None else key_mask.to(torch.bool)

        def keys(sl):
            kd = dense(k[:, :, sl])
            beta, log_alpha = self.writes(kd, scaling, None if mask is None else mask[:, sl])
            return self.feature_k(kd, None, scaling), accum(v[:, :, sl]), beta, log_alpha

        if prefix > 0:
            _, s = self._run(None, *keys(slice(0, prefix)), s)
        if self.needs_grad(q, k, v, state):
            qn = self.feature_q(group_queries(dense(q), hkv), None, scaling)
            o, s = self._run(qn, *keys(slice(prefix, m)), s)
            out = ungroup_output(o).to(q.dtype)
        else:
            out = q.new_empty(b, n, hq, dv)
            block = cost.block_length(b * hq, q.shape[-1], self.options.chunk_size)
            for start in range(0, n, block):
                end = min(start + block, n)
                qn = self.feature_q(group_queries(dense(q[:, :, start:end]), hkv), None, scaling)
                o, s = self._run(qn, *keys(slice(prefix + start, prefix + end)), s)
                out[:, start:end].view(b, end - start, hkv, hq // hkv, dv).permute(0, 2, 3, 1, 4).copy_(o)
        if s is None:  # no keys and no state
            s = q.new_zeros(b, hkv, self.num_features(), dv, dtype=accum(q).dtype)
        return out, self._state(s)

    def _delta_windowed(self, q, k, v, key_mask, scaling, state, offset):
        """The sliding-window hybrid (module docstring). ``state`` holds the memory of the keys before ``k``; the
        memory returned holds every key but the last W - 1 (which the cache passes again), decayed to the last
        key it holds."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        window = self.window
        self.check_positions(offset + m)
        qn, kn = self.features(q, k, scaling, offset)  # [B, H, G, N, D], [B, H, M, D]
        real = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.to(torch.bool)
        writing = real
        sinks = None
        if self.options.sinks:
            sinks = update_sinks(k, v, key_mask, self.options.sinks, offset, None if state is None else state.sinks)
            writing = real & ~sinks.holds(offset, m)
        kd, vv = dense(k), accum(v)
        beta, log_alpha = self.writes(kd, scaling, writing)
        exact, _ = softmax_band(group_queries(accum(q), hkv), kd, linear.with_ones(vv), real,
                                HybridSpec(window=window, scaling=scaling), HybridCall(sinks=sinks, offset=offset))
        out = exact[..., :dv] / exact[..., dv:].clamp_min(1e-30)  # softmax over the window and sinks alone
        s0 = None if state is None else state.S.to(kd.dtype)
        cum = None if log_alpha is None else log_alpha.cumsum(-1)  # b_t from the first key of k
        # the memory read by query p (key position in k) is the one after key p - W: queries shifted W back, with
        # the decay of the window's keys e^{b_p - b_{p-W}}; the last key folded (m - W) is read by no query
        length = max(0, m - window + 1)
        far = qn.new_zeros(*qn.shape[:-1], dv)
        first = m - n  # key position of the first query
        if length:
            shifted = qn.new_zeros(b, hkv, qn.shape[2], length, qn.shape[-1])
            lo = max(first, window)  # query positions p ≥ W read a memory of keys in k
            if lo < m:
                src = qn[:, :, :, lo - first:]
                if cum is not None:
                    src = src * (cum[:, :, lo:] - cum[:, :, lo - window:m - window]).exp()[:, :, None, :, None]
                shifted = torch.cat([shifted[:, :, :, :lo - window], src, shifted[:, :, :, m - window:]], 3)
            o, s = self._run(shifted, kn[:, :, :length], vv[:, :, :length], beta[:, :, :length],
                             None if log_alpha is None else log_alpha[:, :, :length], s0)
            if lo < m:
                far = torch.cat([far[:, :, :, :lo - first], o[:, :, :, lo - window:m - window]], 3)
        else:
            s = s0
        if s0 is not None:  # query positions p < W read the memory before k, decayed by the keys up to p
            hi = min(window, m)
            if first < hi:
                early = qn[:, :, :, :hi - first] @ s0.unsqueeze(2)
                if cum is not None:
                    early = early * cum[:, :, first:hi].exp()[:, :, None, :, None]
                far = torch.cat([early, far[:, :, :, hi - first:]], 3)
        mix = self.branch_mix(hkv, q.device)
        if mix is not None:
            far = far * mix.to(far.dtype)[None, :, :, None, None]
        out = ungroup_output(out + far).to(q.dtype)
        if s is None:
            s = qn.new_zeros(b, hkv, qn.shape[-1], dv)
        new_state = self._state(s)
        if sinks is not None:
            new_state = linear.LinearState(new_state.S, new_state.z, sinks)
        return out, new_state
