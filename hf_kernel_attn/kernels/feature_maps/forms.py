"""The evaluation orders of a feature-map kernel without a window: causal (chunked scan, a block at a time without
autograd, or the quadratic form from a closed form where that is less work), bidirectional (keys' state, then the
queries a block at a time), and any decay through the gated engine (:mod:`..linear.gated`). A mixin of
:class:`.base.LinearKernel`, which holds φ and picks among them (:meth:`.base.LinearKernel.feature_map_forward`)."""

from __future__ import annotations

import torch

from .. import linear
from ..base import accum, group_queries
from ..linear import cost
from ..linear.gated import augmented_state, fold, gated_causal, gated_linear
from ..linear.state import LinearState, with_ones
from .options import dense


class FeatureMapForms:
    """The plain (windowless) forms of :class:`.base.LinearKernel` (module docstring)."""

    def _gated(self, q, k, v, key_mask, causal, scaling, state, offset):
        """A decay (fixed or per token) through the gated engine (:func:`..linear.gated.gated_linear`); without
        autograd the causal form a block at a time (:meth:`_gated_causal_blocked`)."""
        if causal and not self.needs_grad(q, k, v, state):
            return self._gated_causal_blocked(q, k, v, key_mask, scaling, state, offset)
        fq, fk = self.features(q, k, scaling, offset)
        num, den, new_state = gated_linear(fq, fk, v, self.gates(k, scaling), causal=causal, key_mask=key_mask,
                                           state=state, chunk_size=self.options.chunk_size)
        return linear.normalized_output(num, den, self.options.eps).to(q.dtype), new_state

    def _gated_causal_blocked(self, q, k, v, key_mask, scaling, state, offset):
        """The gated causal forward without autograd, a block of whole chunks at a time: features, gates, the scan
        (its state carried from block to block) and the normalisation per block, so that every temporary stays
        the size of a block (fresh N-sized buffers cost more than the arithmetic in them on CPU). The same numbers
        as :func:`..linear.gated.gated_linear`: chunks start at the same positions and see the same state."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        self.check_positions(offset + m)
        kpos = torch.arange(offset, offset + m, device=q.device)
        s = augmented_state(state)
        prefix = m - n
        if prefix > 0:  # keys before the queries: folded into the starting state
            mask = None if key_mask is None else key_mask[:, :prefix]
            fk = self._key_features(k[:, :, :prefix], kpos[:prefix], scaling, mask)
            s = fold(fk, with_ones(accum(v[:, :, :prefix])), self.gates(k[:, :, :prefix], scaling), s)
        out = q.new_empty(b, n, hq, dv)
        chunk = self.options.chunk_size
        block = self.block_length(b * hq)
        for start in range(0, n, block):
            end = min(start + block, n)
            keys = slice(prefix + start, prefix + end)
            mask = None if key_mask is None else key_mask[:, keys]
            fq = self.feature_q(group_queries(dense(q[:, :, start:end]), hkv), kpos[keys], scaling)
            fk = self._key_features(k[:, :, keys], kpos[keys], scaling, mask)
            o, s = gated_causal(fq, fk, with_ones(accum(v[:, :, keys])), self.gates(k[:, :, keys], scaling), s, chunk)
            torch.div(o[..., :dv], o[..., dv:].clamp_min(self.options.eps),
                      out=out[:, start:end].view(b, end - start, hkv, hq // hkv, dv).permute(0, 2, 3, 1, 4))
        if s is None:  # n == 0 and no state
            return out, state
        return out, LinearState(s[..., :dv], s[..., dv])

    def block_length(self, rows: int) -> int:
        """Positions per block of the no-grad causal path: about ``cost.BLOCK_FEATURE_VALUES`` features, whole chunks
        (:func:`..linear.cost.block_length`)."""
        return cost.block_length(rows, self.num_features(), self.options.chunk_size)

    def quadratic_is_cheaper(self, q, k, v, need_state, causal: bool = True) -> bool:
        """For a kernel with a closed form: is the quadratic form (no features for the queries, none for the
        keys unless a state is wanted) less matmul work than the linear form? (The arithmetic:
        :func:`..linear.cost.quadratic_is_cheaper`.) The option ``quadratic_below`` (N at most this: quadratic)
        overrides the choice in both modes."""
        if not self.has_closed_form or self.is_gated:
            return False
        n, m, d, dv, g = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], q.shape[1] // k.shape[1]
        fixed = getattr(self.options, "quadratic_below", None)
        if fixed is not None:
            return n <= fixed
        sizes = cost.FormSizes(n, m, d=d, dv=dv, g=g, f=self.num_features(), chunk_size=self.options.chunk_size)
        return cost.quadratic_is_cheaper(sizes, need_state=need_state, causal=causal)

    def _key_features(self, k, pos, scaling, key_mask):
        """φ(k) of a slice of keys (fp32), zero for padded keys (``key_mask`` the same slice, or None)."""
        fk = self.feature_k(dense(k), pos, scaling)
        return fk if key_mask is None else fk * key_mask[:, None, :, None].to(fk.dtype)

    def _key_state(self, k, v, key_mask, kpos, scaling):
        """The augmented state Σ_j φ(k_j) [v_j, 1]ᵀ ``[B·Hkv, F, Dv + 1]`` over all keys, block by block."""
        b, hkv, m, dv = v.shape
        s_aug = None
        block = self.block_length(b * hkv)
        for start in range(0, m, block):
            end = min(start + block, m)
            mask = None if key_mask is None else key_mask[:, start:end]
            fk = self._key_features(k[:, :, start:end], kpos[start:end], scaling, mask)
            fk = fk.reshape(b * hkv, end - start, -1)
            if s_aug is None:
                s_aug = fk.new_zeros(b * hkv, fk.shape[-1], dv + 1)
            v3 = linear.with_ones(accum(v[:, :, start:end])).view(b * hkv, end - start, dv + 1)
            fkt = fk.transpose(1, 2)
            s_aug = s_aug.baddbmm(fkt, v3) if fk.requires_grad else s_aug.baddbmm_(fkt, v3)
        return s_aug

    def _write_normalized(self, out, start, o):
        """``out[:, start:start + L]`` (``[B, N, Hq, Dv]``) = numerator / max(denominator, eps) of a scan output
        ``o`` ``[B·Hkv, L·G, Dv + 1]``, written straight into out's layout."""
        b, _, hq, dv = out.shape
        hkv = o.shape[0] // b
        g = hq // hkv
        length = o.shape[1] // g
        o = o.view(b, hkv, length, g, dv + 1)
        target = out[:, start:start + length].view(b, length, hkv, g, dv).transpose(1, 2)
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and o.requires_grad):
            # autograd and dynamo take no out= (the same numbers, one temporary more)
            target.copy_(o[..., :dv] / o[..., dv:].clamp_min(self.options.eps))
        else:
            torch.div(o[..., :dv], o[..., dv:].clamp_min(self.options.eps), out=target)

    def _closed_form_attention(self, q, k, v, key_mask, scaling, offset, causal):
        """Attention straight from the closed form, a block of queries at a time against every key
        (bidirectional) or the keys up to the block's end (causal, N = M): scores of one block at most
        ``cost.QUADRATIC_SCORE_VALUES``, never the whole N×M matrix at once."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        g = hq // hkv
        self.check_positions(offset + m)
        closed = self.closed_form(q, k, scaling)
        qp = linear.query_rows(group_queries(closed.q, hkv))
        kt = closed.k.reshape(b * hkv, m, -1).transpose(1, 2)
        weight = None if key_mask is None else _key_weight(key_mask, hkv, kt.dtype)
        v3 = linear.with_ones(accum(v)).view(b * hkv, m, dv + 1)
        out = q.new_empty(b, n, hq, dv)
        block = cost.quadratic_block(n, b * hq * m)
        if causal:
            tril = torch.ones(block, block, dtype=qp.dtype, device=qp.device).tril().repeat_interleave(g, 0)
        for start in range(0, n, block):
            end = min(start + block, n)
            keys = end if causal else m
            scores = closed.fn(torch.bmm(qp[:, start * g:end * g], kt[:, :, :keys]))
            if causal:
                scores = torch.cat([scores[:, :, :start], scores[:, :, start:end] * tril[:(end - start) * g,
                                                                                          :end - start]], -1)
            if weight is not None:
                scores = scores * weight[:, None, :keys]
            self._write_normalized(out, start, torch.bmm(scores, v3[:, :keys]))
        return out

    def _causal_quadratic(self, q, k, v, key_mask, scaling, offset, need_state):
        """Causal attention from the closed form (:meth:`_closed_form_attention`); the state, if wanted,
        from the key features."""
        out = self._closed_form_attention(q, k, v, key_mask, scaling, offset, causal=True)
        if not need_state:
            return out, None
        kpos = torch.arange(offset, offset + q.shape[-2], device=q.device)
        return out, linear.LinearState.from_augmented(self._key_state(k, v, key_mask, kpos, scaling), q.shape[0])

    def _bidirectional_blocked(self, q, k, v, key_mask, scaling, offset):
        """Bidirectional forward: S = Σ φ(k)[v, 1]ᵀ over blocks of keys, then φ(q) S and the normalisation over
        blocks of queries; without autograd no temporary grows with N."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        self.check_positions(offset + m)
        kpos = torch.arange(offset, offset + m, device=q.device)
        s_aug = self._key_state(k, v, key_mask, kpos, scaling)
        out = q.new_empty(b, n, hq, dv)
        block = self.block_length(b * hq)
        for start in range(0, n, block):
            end = min(start + block, n)
            pos = kpos[m - n + start:m - n + end]
            fq = self.feature_q(group_queries(dense(q[:, :, start:end]), hkv), pos, scaling)
            self._write_normalized(out, start, torch.bmm(linear.query_rows(fq), s_aug))
        return out

    def _causal_blocked(self, q, k, v, key_mask, scaling, state, offset):
        """The causal forward without autograd, one block of positions at a time: features, scan,
        normalisation and the output layout per block, so no temporary grows with N."""
        b, hq, n, _ = q.shape
        hkv, m, dv = k.shape[1], k.shape[-2], v.shape[-1]
        self.check_positions(offset + m)
        kpos = torch.arange(offset, offset + m, device=q.device)
        prefix = m - n
        if prefix > 0:
            mask = None if key_mask is None else key_mask[:, :prefix]
            fk = self._key_features(k[:, :, :prefix], kpos[:prefix], scaling, mask)
            state = linear.accumulate(fk, v[:, :, :prefix], state)
        s_aug = None if state is None else state.augmented()
        out = q.new_empty(b, n, hq, dv)
        block = self.block_length(b * hq)
        layout = linear.ScanLayout(hq // hkv, 1, self.options.chunk_size)
        for start in range(0, n, block):
            end = min(start + block, n)
            length = end - start
            keys = slice(prefix + start, prefix + end)
            mask = None if key_mask is None else key_mask[:, keys]
            fq = self.feature_q(group_queries(dense(q[:, :, start:end]), hkv), kpos[keys], scaling)
            fk = self._key_features(k[:, :, keys], kpos[keys], scaling, mask).reshape(b * hkv, length, -1)
            v3 = linear.with_ones(accum(v[:, :, keys])).view(b * hkv, length, dv + 1)
            if s_aug is None:
                s_aug = fk.new_zeros(b * hkv, fk.shape[-1], dv + 1)
            closed = self.closed_form(q[:, :, start:end], k[:, :, keys], scaling)
            if closed is not None:
                closed.q = linear.query_rows(group_queries(closed.q, hkv))
                closed.k = closed.k.reshape(b * hkv, length, -1)
                closed.key_weight = None if mask is None else _key_weight(mask, hkv, closed.k.dtype)
            o = linear.scan(linear.query_rows(fq), fk, v3, s_aug, layout, closed_form=closed)
            self._write_normalized(out, start, o)
        if s_aug is None:  # n == 0
            return out, state
        return out, linear.LinearState.from_augmented(s_aug, b)


def _key_weight(key_mask: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` bool -> ``[B·Hkv, L]`` weights (1 real, 0 padded) in the key rows of :func:`..linear.scan`."""
    b, length = key_mask.shape
    return key_mask[:, None].to(dtype).expand(b, num_kv_heads, length).reshape(b * num_kv_heads, length)
