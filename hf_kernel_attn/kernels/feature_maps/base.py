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

from typing import ClassVar

import torch
from torch import nn

from .. import linear
from ..base import Kernel, LayerShape, group_queries
from ..linear.gated import cumulative, per_feature
from ..linear.state import LinearState, PastKeys
from ..registry import sparse_cache_kernels
from .decoding import PackedDecoding
from .forms import FeatureMapForms
from .hybrid import WindowHybrid
from .options import MAX_SEED, AttentionCall, LinearOptions, dense, layer_generator

__all__ = ["MAX_SEED", "AttentionCall", "LinearKernel", "LinearOptions", "PastKeys", "dense", "layer_generator"]

NO_PAST = PastKeys()  # a call that starts the sequence: no state, first key at position 0


class LinearKernel(FeatureMapForms, WindowHybrid, PackedDecoding, Kernel):
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
    # whether decode steps may move the state into the packed layout of :mod:`.decoding` (False for a kernel whose
    # feature_map_forward keeps a state of its own, as the delta rule's)
    packs_window_state: ClassVar[bool] = True

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

    def num_features(self) -> int:
        """F, the length of φ(x)."""
        return self.shape.head_dim

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

    @property
    def has_closed_form(self) -> bool:
        return type(self).closed_form is not LinearKernel.closed_form

    def closed_form(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> linear.ClosedForm | None:
        """φ(q)·φ(k) as a function of cheaper vectors (``[B, Hq, N, d]`` / ``[B, Hkv, N, d]``), if the kernel
        has one; the no-grad causal path then scores within chunks from it."""
        return None

    def check_positions(self, end: int) -> None:
        """Raise if token positions up to ``end`` (exclusive) are outside what the feature map supports."""

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

    def forward(self, q, k, v, *, key_mask=None, causal=True, scaling=None, dropout=0.0, past: PastKeys | None = None):
        out, _ = self.forward_with_state(q, k, v, key_mask=key_mask, causal=causal, scaling=scaling, past=past,
                                         need_state=False)
        return out

    def forward_with_state(
        self, q, k, v, *, key_mask=None, causal=True, scaling=None, past: PastKeys | None = None, need_state=True
    ) -> tuple[torch.Tensor, linear.LinearState | None]:
        """Like ``forward``; with ``causal`` also returns the state after the last key (``past``: the state of the
        keys before these and the position of the first of them, ``past.offset``; None: no keys before).
        ``need_state=False`` allows returning None instead, when a cheaper evaluation order has no state.

        With ``softmax_heads`` those query heads run exact softmax over every key, softmax_j(s q_i·k_j), in the
        same layer (the rest keep the feature map; retrieval-aware head selection: Wu et al. 2024, "Retrieval
        Head Mechanistically Explains Long-Context Factuality"); the state then also keeps every key/value of
        their KV heads. With ``sparse_cache`` they are retrieval heads on a budget instead: softmax over the sinks,
        the window and the C pairs of their KV head's sparse cache, and nothing else (no linear part, no growing
        K/V)."""
        self.check_inputs(q, k, v, causal)
        scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
        heads = self.options.softmax_heads
        past = NO_PAST if past is None else past
        call = AttentionCall(key_mask, causal, scaling, past.state, past.offset, need_state)
        out, new_state = self.feature_map_forward(q, k, v, call)
        if not heads or self.options.sparse_cache:  # with a sparse cache the heads are bounded (_windowed_sparse)
            return out, new_state
        return self._exact_heads(q, k, v, call, out, new_state)

    def feature_map_forward(self, q, k, v, call: AttentionCall) -> tuple[torch.Tensor, LinearState | None]:
        """The feature-map part of the layer, every head (:meth:`forward_with_state` then overwrites the exact
        heads): ``[B, N, Hq, Dv]`` and the state after the keys. A kernel with a state of its own (the delta rule's
        memory) overrides this; the default takes the window hybrid, the gated engine or the plain forms."""
        key_mask, causal, scaling, state, offset = call.key_mask, call.causal, call.scaling, call.state, call.offset
        need_state = call.need_state
        if self.window:
            return self._windowed(q, k, v, call)
        if self.is_gated:
            return self._gated(q, k, v, key_mask, causal, scaling, state, offset)
        # bidirectional: the evaluation order is chosen by cost alone (every form is differentiable), so the
        # numbers do not depend on the grad mode (reentrant checkpointing recomputes under another one)
        if not causal:
            if self.quadratic_is_cheaper(q, k, v, False, causal=False):
                return self._closed_form_attention(q, k, v, key_mask, scaling, offset, causal=False), None
            return self._bidirectional_blocked(q, k, v, key_mask, scaling, offset), None
        # (a closed form's quadratic causal form too: where it is the cheaper order, N ≲ 2F, its autograd memory
        # of N² scores is within about twice the features' F·N; F = 2,145 for taylor at D = 64)
        if causal and state is None and q.shape[-2] == k.shape[-2] and self.quadratic_is_cheaper(
                q, k, v, need_state):
            return self._causal_quadratic(q, k, v, key_mask, scaling, offset, need_state)
        if causal and not self.needs_grad(q, k, v, state):
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

    def needs_grad(self, q, k, v, state) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [q, k, v, *self.parameters()]
        if state is not None:
            tensors += [state.S, state.z]
        return any(t.requires_grad for t in tensors)
