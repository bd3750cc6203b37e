"""The machinery every feature-map kernel shares: :class:`LinearKernel` (φ(q)·φ(k) standing in for exp(s q·k))
and its options :class:`LinearOptions`.

Every kernel evaluates the same normalised form through the engine of :mod:`..linear`; they differ only in φ
and in their decay: none, a fixed one per KV head (:meth:`LinearKernel.log_decay`, DiJiang) or a gate per token
(:meth:`LinearKernel.log_gate`, the gated kernels); a fixed decay is the constant gate, so every decay runs the one
gated engine (:mod:`..linear.gated`). φ always runs in fp32 on RoPE-rotated q/k, once per call.
Positions are token indices within the sequence (including any past folded into a state); only
differences of positions enter a score, so left padding does not change real tokens' outputs.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from .. import linear
from ..base import (
    EPS_RANGE,
    MAX_TOKENS,
    Kernel,
    KernelOptions,
    LayerShape,
    accum,
    group_queries,
    integer_in,
    number_in,
    one_of,
    option,
    ungroup_output,
    visibility_mask,
)
from ..linear import cost, window_decode
from ..linear.gated import (
    augmented_state,
    cumulative,
    fold,
    gated_causal,
    gated_hybrid,
    gated_linear,
    per_feature,
)
from ..linear.sparse_cache import sparse_window
from ..linear.state import LinearState, with_ones
from ..linear.window import hybrid_attention, update_sinks
from ..registry import sparse_cache_kernels


@dataclasses.dataclass
class LinearOptions(KernelOptions):
    eps: float = option(1e-6, "floor of the normaliser φ(q_i)·Σ_j φ(k_j)")
    chunk_size: int = option(linear.DEFAULT_CHUNK, "positions per chunk of the causal chunked scan (speed and "
                                                   "memory, not results)", bound="tokens")
    window: int = option(0, "W > 0: exact softmax over the last W keys, the feature map over older ones "
                            "(sliding-window hybrid)", bound="tokens")
    window_mix: bool = option(False, "a learnable per-head factor λ_h = exp(θ_h) on the feature-map part "
                                     "(LoLCATs; needs a window)")
    sinks: int = option(0, "S > 0 (needs a window): the first S real tokens join the softmax part (StreamingLLM)",
                        bound="tokens")
    softmax_heads: list[int] = option(default_factory=list, help="query heads of each layer kept as exact softmax "
                                                                 "attention (over every key; with sparse_cache, "
                                                                 "over the sinks, window and cached pairs only)")
    sparse_cache: int = option(0, "C > 0 (needs a window; causal): per KV head, the C older key-value pairs the "
                                  "state reproduces worst are kept and attended exactly (a bounded sparse cache, "
                                  "LoLA; slots are filled as keys leave the window: unused slots cost nothing)",
                               bound="tokens")
    sparse_block: int = option(16, "with sparse_cache: the keys that left the window are scored every this many "
                                   "positions (decoding keeps at most this many of them besides the cache)",
                                bound="tokens")

    def validate(self) -> None:
        number_in("eps", self.eps, EPS_RANGE[0], EPS_RANGE[1], meaning="a floor far below the normaliser")
        integer_in("chunk_size", self.chunk_size, 1, MAX_TOKENS, meaning="positions per chunk")
        integer_in("window", self.window, 0, MAX_TOKENS, meaning="0 = no softmax window")
        one_of("window_mix", self.window_mix, (True, False))
        if self.window_mix and not self.window:
            raise ValueError("window_mix=True needs a window > 0 (it is a learnable factor on the part beyond the "
                             "window: the feature map's, or the delta-rule memory's read-out)")
        integer_in("sinks", self.sinks, 0, MAX_TOKENS, meaning="the first S real tokens attended exactly by every "
                   "query; 0 = none")
        if self.sinks and not self.window:
            raise ValueError(f"sinks={self.sinks} needs a window > 0 (sinks join the softmax window of the hybrid); "
                             "set window=W as well, or sinks=0")
        integer_in("sparse_cache", self.sparse_cache, 0, MAX_TOKENS, meaning="cached pairs per KV head; 0 = none")
        integer_in("sparse_block", self.sparse_block, 1, MAX_TOKENS, meaning="positions between two choices")
        if self.sparse_cache and not self.window:
            raise ValueError(f"sparse_cache={self.sparse_cache} needs a window > 0 (the cache holds pairs that left "
                             "the softmax window); set window=W as well, or sparse_cache=0")
        heads = self.softmax_heads
        if isinstance(heads, tuple):
            self.softmax_heads = heads = list(heads)
        if (not isinstance(heads, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in heads)
                or len(set(heads)) != len(heads)):
            raise ValueError(f"softmax_heads must be a list of distinct query-head indices >= 0 (the heads of the "
                             f"layer kept as exact softmax attention), got {heads!r}")


def dense(x: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype, contiguous: transformers hands q/k over as transposed views, and a feature map's
    matmul on a strided view runs several times slower than on dense rows (one copy is cheaper)."""
    return accum(x).contiguous()


MAX_SEED = 2**32 - 1  # seeds of random draws: seed · 1,000,003 + layer index stays within a generator's 64 bits


def layer_generator(seed: int, layer_idx: int) -> torch.Generator:
    """The generator of one layer's random draws (performer's ω, DiJiang's w): from ``seed`` and the layer index."""
    return torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)


class LinearKernel(Kernel):
    """out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / max(φ(q_i)ᵀ Σ_j φ(k_j), eps); with the option ``window`` W > 0, the
    sliding-window hybrid of :mod:`..linear.window` (softmax over the last W keys, φ over the older ones)."""

    is_linear: ClassVar[bool] = True
    kind: ClassVar[str] = "linear"
    options_cls = LinearOptions
    # a diagnostic switch, not an option (never saved): True drops the feature-map part of a windowed hybrid,
    # leaving softmax over the window alone (integration/branches.py)
    linear_branch_off: bool = False
    # whether the option sparse_cache works: the state must give a pair back exactly when it leaves the cache
    # (no decay) and φ(k) must not depend on the position (the cache keeps keys, not features)
    supports_sparse_cache: ClassVar[bool] = True

    def __init__(self, shape: LayerShape, options: LinearOptions) -> None:
        super().__init__(shape, options)
        bad = [h for h in options.softmax_heads if h >= shape.num_heads]
        if bad:
            raise ValueError(f"softmax_heads={options.softmax_heads}: head index {bad} out of range, the layer has "
                             f"{shape.num_heads} query heads (valid 0..{shape.num_heads - 1})")
        if options.window_mix:
            self.window_log_mix = nn.Parameter(torch.zeros(shape.num_heads))  # ln λ_h per query head
        if options.sparse_cache and not self.supports_sparse_cache:
            raise ValueError(f"{self.name}: sparse_cache={options.sparse_cache} is not supported by this kernel (its "
                             f"state has a decay or its φ depends on the position); kernels that support it: "
                             f"{', '.join(sparse_cache_kernels())}")

    def reset_parameters(self) -> None:
        """Subclasses with parameters of their own call this too."""
        if hasattr(self, "window_log_mix"):
            with torch.no_grad():
                self.window_log_mix.zero_()

    @property
    def window(self) -> int:
        return self.options.window

    def feature_q(self, q: torch.Tensor, pos: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[B, Hkv, G, N, D]`` fp32 -> ``[B, Hkv, G, N, F]``."""
        return self.feature(q, pos, scaling)

    def feature_k(self, k: torch.Tensor, pos: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[B, Hkv, M, D]`` fp32 -> ``[B, Hkv, M, F]``."""
        return self.feature(k, pos, scaling)

    def feature(self, x: torch.Tensor, pos: torch.Tensor, scaling: float) -> torch.Tensor:
        raise NotImplementedError

    def log_decay(self) -> torch.Tensor | None:
        """ln γ_h ``[Hkv]`` of a fixed decay (key j reaches query i with weight γ_h^|i-j|), or None (no decay)."""
        return None

    def log_gate(self, k: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """log α_t ≤ 0 ``[B, Hkv, M, Γ]`` for the keys ``[B, Hkv, M, D]`` (key j reaches query i ≥ j with weight
        Π_{j < s ≤ i} α_s per feature, feature f reading gate f mod Γ), or None (no decay). By default the fixed
        decay of :meth:`log_decay` as a constant gate (Γ = 1)."""
        decay = self.log_decay()
        if decay is None:
            return None
        b, h, m, _ = k.shape
        dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
        return decay.to(device=k.device, dtype=dtype).view(1, h, 1, 1).expand(b, h, m, 1)

    def gates(self, k: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """The gates the forms use (:meth:`log_gate`; gated kernels clamp theirs)."""
        return self.log_gate(k, scaling)

    def gate_flops(self, n: int) -> float:
        """Matmul FLOPs of the gates of one sequence of ``n`` keys, all KV heads (benchmark FLOPs; 0: no matmul)."""
        return 0.0

    @property
    def is_gated(self) -> bool:
        """Whether the kernel has a decay (fixed or per token), which the gated engine evaluates."""
        return type(self).log_gate is not LinearKernel.log_gate or self.log_decay() is not None

    def scores(self, q, k, scaling):
        """κ_ij = Σ_f φ_f(q_i) φ_f(k_j) e^{-|b_{p_i} - b_j|_f} ``[B, Hq, N, M]`` (b the running sum of the log-gates,
        0 without a decay); query i sits at position M - N + i. Without the window option's softmax part."""
        fq, fk = self.features(q, k, scaling)  # [B, Hkv, G, N, F], [B, Hkv, M, F]
        gates = self.gates(k, scaling)
        if gates is None:
            return torch.einsum("bhgnf,bhmf->bhgnm", fq, fk).flatten(1, 2)
        n, m = q.shape[-2], k.shape[-2]
        b = cumulative(gates.to(fq.dtype))  # [B, H, M, Γ]
        if b.shape[-1] == 1:  # one gate per head: a weight per pair
            weight = (-(b[:, :, m - n:, None, 0] - b[:, :, None, :, 0]).abs()).exp()  # [B, H, N, M]
            return (torch.einsum("bhgnf,bhmf->bhgnm", fq, fk) * weight[:, :, None]).flatten(1, 2)
        b = per_feature(b, fk.shape[-1])
        weight = (-(b[:, :, m - n:, None] - b[:, :, None, :]).abs()).exp()  # [B, H, N, M, F]
        return torch.einsum("bhgnf,bhmf,bhnmf->bhgnm", fq, fk, weight).flatten(1, 2)

    def log_scores(self, q, k, scaling):
        return self.scores(q, k, scaling).clamp_min(1e-300).log()

    def check_positions(self, end: int) -> None:
        """Raise if token positions up to ``end`` (exclusive) are outside what the feature map supports."""

    def features(self, q, k, scaling, offset=0, key_rows: int | None = None):
        """φ(q) grouped by KV head and φ(k); query i sits at position offset + M - N + i. With ``key_rows`` R only
        the first R keys get their features (the other rows are zero: for callers that read no other row)."""
        n, m = q.shape[-2], k.shape[-2]
        self.check_positions(offset + m)
        kpos = torch.arange(offset, offset + m, device=q.device)
        fq = self.feature_q(group_queries(dense(q), k.shape[1]), kpos[m - n:], scaling)
        if key_rows is None:
            return fq, self.feature_k(dense(k), kpos, scaling)
        fk = self.feature_k(dense(k[:, :, :key_rows]), kpos[:key_rows], scaling)
        return fq, torch.cat([fk, fk.new_zeros(*fk.shape[:2], m - key_rows, fk.shape[-1])], 2)

    def forward(self, q, k, v, *, key_mask=None, causal=True, scaling=None, dropout=0.0, state=None, offset=0):
        out, _ = self.forward_with_state(q, k, v, key_mask=key_mask, causal=causal, scaling=scaling,
                                         state=state, offset=offset, need_state=False)
        return out

    def num_features(self) -> int:
        """F, the length of φ(x)."""
        return self.shape.head_dim

    def forward_with_state(
        self, q, k, v, *, key_mask=None, causal=True, scaling=None, state=None, offset=0, need_state=True
    ) -> tuple[torch.Tensor, linear.LinearState | None]:
        """Like ``forward``; with ``causal`` also returns the state after the last key (``state`` = the
        keys before these, ``offset`` = how many there were). ``need_state=False`` allows returning None
        instead, when a cheaper evaluation order has no state.

        With ``softmax_heads`` those query heads run exact softmax over every key, softmax_j(s q_i·k_j), in the
        same layer (the rest keep the feature map; retrieval-aware head selection: Wu et al. 2024, "Retrieval
        Head Mechanistically Explains Long-Context Factuality"); the state then also keeps every key/value of
        their KV heads. With ``sparse_cache`` they are retrieval heads on a budget instead: softmax over the sinks,
        the window and the C pairs of their KV head's sparse cache, and nothing else (no linear part, no growing
        K/V)."""
        self.check_inputs(q, k, v, causal)
        scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
        heads = self.options.softmax_heads
        out, new_state = self._feature_map_with_state(q, k, v, key_mask, causal, scaling, state, offset, need_state)
        if not heads or self.options.sparse_cache:  # with a sparse cache the heads are bounded (_windowed_sparse)
            return out, new_state
        return self._exact_heads(q, k, v, key_mask, causal, scaling, state, offset, need_state, out, new_state)

    def _exact_heads(self, q, k, v, key_mask, causal, scaling, state, offset, need_state, out, new_state):
        """Overwrite the ``softmax_heads`` of ``out`` ``[B, N, Hq, Dv]`` with exact softmax over every key seen
        (the kept K/V of earlier calls, then these)."""
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

    def _feature_map_with_state(self, q, k, v, key_mask, causal, scaling, state, offset, need_state):
        if self.window:
            return self._windowed(q, k, v, key_mask, causal, scaling, state, offset, need_state)
        if self.is_gated:
            return self._gated(q, k, v, key_mask, causal, scaling, state, offset)
        # bidirectional: the evaluation order is chosen by cost alone (every form is differentiable), so the
        # numbers do not depend on the grad mode (reentrant checkpointing recomputes under another one)
        if not causal:
            if self._quadratic_is_cheaper(q, k, v, False, causal=False):
                return self._closed_form_attention(q, k, v, key_mask, scaling, offset, causal=False), None
            return self._bidirectional_blocked(q, k, v, key_mask, scaling, offset), None
        # (a closed form's quadratic causal form too: where it is the cheaper order, N ≲ 2F, its autograd memory
        # of N² scores is within about twice the features' F·N; F = 2,145 for taylor at D = 64)
        if causal and state is None and q.shape[-2] == k.shape[-2] and self._quadratic_is_cheaper(
                q, k, v, need_state):
            return self._causal_quadratic(q, k, v, key_mask, scaling, offset, need_state)
        if causal and not self._needs_grad(q, k, v, state):
            return self._causal_blocked(q, k, v, key_mask, scaling, state, offset)
        fq, fk = self.features(q, k, scaling, offset)
        if key_mask is not None:
            fk = fk * key_mask[:, None, :, None].to(fk.dtype)
        prefix = k.shape[-2] - q.shape[-2]
        if prefix > 0:
            state = linear.accumulate(fk[:, :, :prefix], v[:, :, :prefix], state)
        num, den, state = linear.causal_chunked(fq, fk[:, :, prefix:], v[:, :, prefix:], state=state,
                                                chunk_size=self.options.chunk_size)
        return linear.normalized_output(num, den, self.options.eps).to(q.dtype), state

    def _gated(self, q, k, v, key_mask, causal, scaling, state, offset):
        """A decay (fixed or per token) through the gated engine (:func:`..linear.gated.gated_linear`); without
        autograd the causal form a block at a time (:meth:`_gated_causal_blocked`)."""
        if causal and not self._needs_grad(q, k, v, state):
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
        block = self._block_length(b * hq)
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

    def _windowed(self, q, k, v, key_mask, causal, scaling, state, offset, need_state):
        """The sliding-window hybrid (:func:`..linear.window.hybrid_attention`); the state (causal) holds the keys
        before ``k``, and the one returned holds every key but the last W - 1."""
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
        if self.options.sparse_cache:
            return self._windowed_sparse(q, k, v, fq, fk, key_mask, causal, scaling, state, offset, log_mix, sinks)
        if self.is_gated:
            out, new_state = gated_hybrid(
                group_queries(q, hkv), k, v, fq, fk, self.gates(k, scaling), window=self.window, scaling=scaling,
                causal=causal, key_mask=key_mask, state=state, log_mix=log_mix, chunk_size=self.options.chunk_size,
                sinks=sinks, offset=offset)
            out = ungroup_output(out).to(q.dtype)
        else:
            out, new_state = hybrid_attention(
                group_queries(q, hkv), k, v, fq, fk, window=self.window, scaling=scaling, causal=causal,
                key_mask=key_mask, state=state, log_mix=log_mix, chunk_size=self.options.chunk_size,
                need_state=need_state and causal, blocked=not self._needs_grad(q, k, v, state), sinks=sinks,
                offset=offset,
            )
        if new_state is not None and sinks is not None:
            new_state = linear.LinearState(new_state.S, new_state.z, sinks)
        return out, new_state

    def _windowed_sparse(self, q, k, v, fq, fk, key_mask, causal, scaling, state, offset, log_mix, sinks):
        """The hybrid with its bounded sparse cache (:func:`..linear.sparse_cache.sparse_window`): the plain hybrid's
        sums from a state without the cache, corrected for the pairs the cache holds."""
        if not causal:
            raise ValueError(f"{self.name}: sparse_cache is causal only (the cache holds pairs that left a causal "
                             "window); use sparse_cache=0 for bidirectional attention")
        hkv = k.shape[1]
        gq = group_queries(q, hkv)
        log_mix = self._budgeted_heads_off(log_mix, hkv, q.device)
        raw, top = hybrid_attention(gq, k, v, fq, fk, window=self.window, scaling=scaling, causal=True,
                                    key_mask=key_mask, state=state, log_mix=log_mix, chunk_size=self.options.chunk_size,
                                    sinks=sinks, offset=offset, raw=True, blocked=not self._needs_grad(q, k, v, state))
        b, m = k.shape[0], k.shape[-2]
        lin_w = torch.ones(b, m, dtype=torch.bool, device=k.device) if key_mask is None else key_mask.to(torch.bool)
        if sinks is not None:
            lin_w = lin_w & ~sinks.holds(offset, m)
        zero = torch.zeros(1, device=k.device, dtype=torch.long)

        def key_features(keys: torch.Tensor) -> torch.Tensor:
            return self.feature_k(dense(keys), zero.expand(keys.shape[-2]), scaling).to(raw.dtype)

        out, s, cache = sparse_window(
            raw, top, accum(gq), fq, accum(k), accum(v), fk, lin_w, state, None if state is None else state.sparse,
            key_features, window=self.window, capacity=self.options.sparse_cache, block=self.options.sparse_block,
            scaling=scaling, offset=offset, mix=None if log_mix is None else log_mix.exp(), eps=self.options.eps)
        dv = v.shape[-1]
        return ungroup_output(out).to(q.dtype), linear.LinearState(s[..., :dv], s[..., dv], sinks, sparse=cache)

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

    @property
    def decodes_packed(self) -> bool:
        """Whether decode steps can run on the packed layout of :mod:`..linear.window_decode`: a window hybrid
        without a decay, with or without a sparse cache, and no exact heads that keep every key, evaluated by this
        class's forms (a kernel with a state of its own, as the delta rule's, overrides them and is not packed)."""
        exact_heads = bool(self.options.softmax_heads) and not self.options.sparse_cache
        own_forms = (type(self)._feature_map_with_state is LinearKernel._feature_map_with_state
                     and type(self)._windowed is LinearKernel._windowed)
        return bool(self.window and not self.is_gated and not exact_heads and own_forms)

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
        return (key_mask is None and q.shape[-2] == 1 and self.decodes_packed and not self._needs_grad(q, k, v, None)
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

        out = window_decode.decode_step(
            packed, q.reshape(b, hkv, hq // hkv, d), k, v, feature_q, scaling=scaling, log_mix=log_mix,
            linear=linear_part, block=self.options.sparse_block, eps=self.options.eps)
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

    @property
    def has_closed_form(self) -> bool:
        return type(self).closed_form is not LinearKernel.closed_form

    def closed_form(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> linear.ClosedForm | None:
        """φ(q)·φ(k) as a function of cheaper vectors (``[B, Hq, N, d]`` / ``[B, Hkv, N, d]``), if the kernel
        has one; the no-grad causal path then scores within chunks from it."""
        return None

    def _needs_grad(self, q, k, v, state) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [q, k, v, *self.parameters()]
        if state is not None:
            tensors += [state.S, state.z]
        return any(t.requires_grad for t in tensors)

    def _block_length(self, rows: int) -> int:
        """Positions per block of the no-grad causal path: about ``cost.BLOCK_FEATURE_VALUES`` features, whole chunks
        (:func:`..linear.cost.block_length`)."""
        return cost.block_length(rows, self.num_features(), self.options.chunk_size)

    def _quadratic_is_cheaper(self, q, k, v, need_state, causal: bool = True) -> bool:
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
        return cost.quadratic_is_cheaper(n, m, d=d, dv=dv, g=g, f=self.num_features(),
                                         chunk_size=self.options.chunk_size, need_state=need_state, causal=causal)

    def _key_features(self, k, pos, scaling, key_mask):
        """φ(k) of a slice of keys (fp32), zero for padded keys (``key_mask`` the same slice, or None)."""
        fk = self.feature_k(dense(k), pos, scaling)
        return fk if key_mask is None else fk * key_mask[:, None, :, None].to(fk.dtype)

    def _key_state(self, k, v, key_mask, kpos, scaling):
        """The augmented state Σ_j φ(k_j) [v_j, 1]ᵀ ``[B·Hkv, F, Dv + 1]`` over all keys, block by block."""
        b, hkv, m, dv = v.shape
        s_aug = None
        block = self._block_length(b * hkv)
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
        block = self._block_length(b * hq)
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
        block = self._block_length(b * hq)
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
            o = linear.scan(linear.query_rows(fq), fk, v3, s_aug, gq=hq // hkv, gk=1,
                            chunk_size=self.options.chunk_size, closed_form=closed)
            self._write_normalized(out, start, o)
        if s_aug is None:  # n == 0
            return out, state
        return out, linear.LinearState.from_augmented(s_aug, b)


def _key_weight(key_mask: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` bool -> ``[B·Hkv, L]`` weights (1 real, 0 padded) in the key rows of :func:`..linear.scan`."""
    b, length = key_mask.shape
    return key_mask[:, None].to(dtype).expand(b, num_kv_heads, length).reshape(b * num_kv_heads, length)
