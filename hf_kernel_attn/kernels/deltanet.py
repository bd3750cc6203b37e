"""DeltaNet and Gated DeltaNet (kind ``delta``): linear attention whose memory is written by the delta rule.

Linear attention adds v_t φ(k_t)ᵀ to its memory for every token, so old associations are never removed and a
normaliser keeps the sum in range. DeltaNet (Schlag, Irie, Schmidhuber, ICML 2021, "Linear Transformers Are
Secretly Fast Weight Programmers") instead corrects what the memory returns for the key towards the value, by a
learnt step β_t; Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025, "Gated Delta Networks") also decays the whole
memory by α_t ∈ (0, 1) first:

    S_t = α_t S_{t-1} (I - β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,      o_t = S_t q̂_t      (α_t = 1 for DeltaNet)

with q̂, k̂ = φ(q)/||φ(q)||, φ(k)/||φ(k)|| (φ the option ``feature_map``: identity, silu, elu + 1, or hedgehog's learnable
per-head map, Zhang et al. ICLR 2024, whose 2D features double the memory's key side) on the layer's RoPE-rotated
queries and keys.
The output is not normalised (the memory is a map from keys to values, not a sum of them), and the host's softmax
scale is not used by it (q̂ has unit norm). Causal only: the memory is a recurrence over the tokens in order.

* β_t = σ(s^1/2 ρ_t · w_h + c_h) per KV head, ρ_t the norms of the RoPE rotation pairs of k_t (unchanged by RoPE, as
  the gates of :mod:`.feature_maps.gated`, so β does not depend on where the token sits), s the softmax scale; w starts
  at 0 and c at 0, so every β starts at 1/2 and attention transfer learns them. ``beta=<number>`` fixes β instead.
* α_t: the learnable low-rank gate of GLA from the same pair norms (:func:`.feature_maps.gated.low_rank_log_gate`,
  one gate per KV head, Γ = 1), clamped as every gated kernel's; it starts at α = σ(4)^(1/τ) ≈ 0.999.

Forms (:mod:`.delta_rule`, run by :mod:`.deltanet_forms`): the chunked WY / UT-transform form (Yang, Wang, Zhang,
Shen, Kim, NeurIPS 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length") for training
and prefill, a block of chunks at a time without autograd; the recurrent step for decoding from the memory (the cache
keeps S ``[B, Hkv, D, Dv]`` per layer, constant in the context); the token recurrence as the reference. Key padding:
a padded key neither writes nor decays the memory. Packed rows reset the memory at each document (the dispatcher runs
each document alone). ``softmax_heads`` keeps query heads exact, as for the feature maps.

With ``window=W`` (the sliding-window hybrid): exact softmax over the last W keys (and the ``sinks`` first real
tokens), plus the delta-rule read-out of the keys older than the window, the memory after key i - W, decayed to i:

    out_i = softmax_{j ∈ win(i) ∪ sinks}(s q_i·k_j) v_j  +  λ_h e^{b_i - b_{i-W}} S_{i-W} q̂_i

(b the running sum of ln α; sinks neither write nor decay). The read-out has no normaliser to share with the window,
so the two parts add; for N ≤ W it is the exact softmax alone. λ_h = 1, or with ``window_mix`` a learnable factor
per query head that starts at ``mix_init`` (0 by default) and enters linearly: the swapped model then starts as
its window (and sinks) softmax alone, the nearest to softmax a bounded cache gets, and training grows the
memory's read-out where it helps. (Starting at λ = 1 with an untrained β, the read-out is a large wrong term: an
untrained SmolLM2 deltanet-window64 had a held-out perplexity of 31,492.) The feature-map hybrids' λ = exp(θ)
starts at 1 instead, because their linear part shares the window's normaliser and is a small share of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import nn

from .base import LayerShape, accum, group_queries, number_in, one_of, option, ungroup_output
from .delta_rule import DEFAULT_CHUNK, delta_rule_naive
from .deltanet_forms import DeltaRuleForms
from .feature_maps.base import AttentionCall, LinearKernel, LinearOptions, dense
from .feature_maps.elu import positive_elu
from .feature_maps.gated import (
    ROPE_PAIRS,
    check_low_rank_gate,
    clamp_log_gate,
    low_rank_log_gate,
    pair_norms,
    reset_low_rank_gate,
    rope_halves,
)
from .feature_maps.hedgehog import HedgehogKernel
from .linear.gated import queries_at_key_positions
from .registry import causal_only_kernels

FEATURE_MAPS = ("identity", "silu", "elu", "hedgehog")


@dataclasses.dataclass
class DeltaNetOptions(LinearOptions):
    eps: float = option(1e-6, "floor of ||φ(x)|| in the L2 normalisation of queries and keys")
    chunk_size: int = option(DEFAULT_CHUNK, "positions per chunk of the chunked WY form (speed and memory, not "
                                            "results)", bound="tokens")
    window: int = option(0, "W > 0: exact softmax over the last W keys plus the delta-rule memory of the older ones "
                            "(sliding-window hybrid; the two parts add)", bound="tokens")
    window_mix: bool = option(False, "a learnable per-head factor λ_h on the memory's read-out, starting at "
                                     "mix_init (needs a window)")
    mix_init: float = option(0.0, "with window_mix: λ_h at the start (0: the model starts as its window and sinks "
                                  "softmax alone, near softmax)")
    feature_map: str = option("identity", "φ before the L2 normalisation of q and k: identity, silu, elu (elu + 1) "
                                          "or hedgehog (learnable [softmax(s^1/2 xW + b), softmax(-(s^1/2 xW + b))] "
                                          "per head, W = I and b = 0 at the start; 2D features)")
    beta: float | None = option(None, "None: a learnable write strength β_t = σ(s^1/2 ρ_t·w + c) per KV head "
                                      "(starts at 1/2); a number in (0, 1]: that fixed β for every token")
    rope_pairs: str = option("half", "RoPE's rotation pairs (β and α read their norms): half = (i, i + D/2) "
                                     "(transformers' rotate_half), interleaved = (2i, 2i+1)")

    def validate(self) -> None:
        super().validate()
        one_of("feature_map", self.feature_map, FEATURE_MAPS)
        one_of("rope_pairs", self.rope_pairs, ROPE_PAIRS)
        number_in("mix_init", self.mix_init, -1e3, 1e3, meaning="the memory read-out's factor λ_h at the start, "
                  "with window_mix")
        if self.beta is not None and (isinstance(self.beta, bool) or not isinstance(self.beta, (int, float))
                                      or not 0 < self.beta <= 1):
            raise ValueError(f"beta must be None (learnable) or a number in (0, 1], got {self.beta!r}")


@dataclasses.dataclass
class GatedDeltaNetOptions(DeltaNetOptions):
    gate_rank: int = option(16, "rank r of the learnable low-rank decay gate (GLA's W₁W₂)")
    gate_temperature: float = option(16.0, "τ: ln α = ln σ(·) / τ (GLA's normaliser)")

    def validate(self) -> None:
        super().validate()
        check_low_rank_gate(self.gate_rank, self.gate_temperature)


class DeltaNetKernel(DeltaRuleForms, LinearKernel):
    """DeltaNet: the delta rule on L2-normalised φ(q), φ(k) with a learnable write strength β_t (module docstring)."""
    supports_sparse_cache: ClassVar[bool] = False  # a delta-rule state cannot give a pair back
    packs_window_state: ClassVar[bool] = False  # its memory is its own, not the packed layout's [S, z]

    name = "deltanet"
    kind: ClassVar[str] = "delta"
    options_cls = DeltaNetOptions
    supports_bidirectional: ClassVar[bool] = False
    paper = ("Schlag, Irie, Schmidhuber, ICML 2021, Linear Transformers Are Secretly Fast Weight Programmers; "
             "chunked form: Yang et al., NeurIPS 2024, Parallelizing Linear Transformers with the Delta Rule")

    def __init__(self, shape: LayerShape, options: DeltaNetOptions) -> None:
        super().__init__(shape, options)
        if options.window_mix:  # λ_h enters linearly here (it starts at 0), not as the feature maps' exp(θ_h)
            del self.window_log_mix
            self.memory_mix = nn.Parameter(torch.empty(shape.num_heads))
        if options.beta is None:
            pairs = -(-shape.head_dim // 2)
            self.beta_weight = nn.Parameter(torch.empty(shape.num_kv_heads, pairs))
            self.beta_bias = nn.Parameter(torch.empty(shape.num_kv_heads))
        if options.feature_map == "hedgehog":  # hedgehog's maps: one per query head, one per KV head
            d = shape.head_dim
            self.weight_q = nn.Parameter(torch.empty(shape.num_heads, d, d))
            self.bias_q = nn.Parameter(torch.empty(shape.num_heads, d))
            self.weight_k = nn.Parameter(torch.empty(shape.num_kv_heads, d, d))
            self.bias_k = nn.Parameter(torch.empty(shape.num_kv_heads, d))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            if hasattr(self, "memory_mix"):
                self.memory_mix.fill_(float(self.options.mix_init))
            if hasattr(self, "beta_weight"):
                self.beta_weight.zero_()
                self.beta_bias.zero_()
            if hasattr(self, "weight_q"):
                for w in (self.weight_q, self.weight_k):
                    w.copy_(torch.eye(w.shape[-1]).expand_as(w))
                self.bias_q.zero_()
                self.bias_k.zero_()

    def num_features(self) -> int:
        """The key dimension of the memory: D, or 2D with hedgehog's map."""
        return 2 * self.shape.head_dim if self.options.feature_map == "hedgehog" else self.shape.head_dim

    def projection_width(self, backward: bool = False) -> int:
        return self.shape.head_dim if self.options.feature_map == "hedgehog" else 0

    # ------------------------------------------------------------------------------------------ definition

    def feature_q(self, q, pos, scaling):
        if self.options.feature_map != "hedgehog":
            return self.feature(q, pos, scaling)
        hkv, g = q.shape[1], q.shape[2]
        w = self.weight_q.view(hkv, g, *self.weight_q.shape[1:])
        fq = HedgehogKernel._map(q, w, self.bias_q.view(hkv, g, -1), scaling)
        return nn.functional.normalize(fq, dim=-1, eps=self.options.eps)

    def feature_k(self, k, pos, scaling):
        if self.options.feature_map != "hedgehog":
            return self.feature(k, pos, scaling)
        fk = HedgehogKernel._map(k, self.weight_k, self.bias_k, scaling)
        return nn.functional.normalize(fk, dim=-1, eps=self.options.eps)

    def feature(self, x, pos, scaling):
        """q̂ or k̂: φ(x) / max(||φ(x)||, eps) (elementwise maps; hedgehog's: :meth:`feature_q` / :meth:`feature_k`)."""
        fmap = self.options.feature_map
        if fmap == "silu":
            x = nn.functional.silu(x)
        elif fmap == "elu":
            x = positive_elu(x)
        return nn.functional.normalize(x, dim=-1, eps=self.options.eps)

    def branch_mix(self, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        """λ ``[Hkv, G]`` on the memory's read-out beyond the window: the learnable factor (``window_mix``), 0
        while :attr:`linear_branch_off` is set (the window alone), else None (λ = 1)."""
        mix = getattr(self, "memory_mix", None)
        if self.linear_branch_off:
            return torch.zeros(num_kv_heads, self.shape.num_heads // num_kv_heads, device=device)
        return None if mix is None else mix.view(num_kv_heads, -1)

    def write_strength(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """β_t ∈ (0, 1] ``[B, Hkv, M]`` from the keys ``[B, Hkv, M, D]`` (fp32 or fp64)."""
        b, h, m, _ = k.shape
        if self.options.beta is not None:
            return k.new_full((b, h, m), float(self.options.beta))
        rho = pair_norms(rope_halves(k, self.options.rope_pairs))  # [B, H, M, P]
        w = self.beta_weight.to(rho.dtype) * math.sqrt(scaling)
        return torch.sigmoid((rho @ w[None, :, :, None]).squeeze(-1) + self.beta_bias.to(rho.dtype)[None, :, None])

    def log_alpha(self, k: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """ln α_t ≤ 0 ``[B, Hkv, M]`` of a gated kernel (one decay per KV head), or None (no decay)."""
        gates = self.gates(k, scaling)
        return None if gates is None else gates[..., 0]

    def writes(self, k: torch.Tensor, scaling: float, writing: torch.Tensor | None):
        """β and ln α of the keys ``k`` (accumulation dtype), zero where ``writing`` ``[B, M]`` is False (padding,
        sinks): such a key neither writes nor decays the memory."""
        beta = self.write_strength(k, scaling)
        log_alpha = self.log_alpha(k, scaling)
        if writing is not None:
            w = writing[:, None, :].to(beta.dtype)
            beta = beta * w
            log_alpha = None if log_alpha is None else log_alpha * w
        return beta, log_alpha

    def scores(self, q, k, scaling):
        raise NotImplementedError(f"kernel {self.name!r} is not of the form Σ κ v / Σ κ (the delta rule's output is "
                                  "linear in the values through a recurrence); its definition is reference()")

    def reference(self, q, k, v, *, key_mask=None, causal=True, scaling=None):
        """The definition, by the token recurrence (:func:`.delta_rule.delta_rule_naive`) and, with a window, the
        explicit softmax over each query's window and sinks plus the read-out of the memory after key i - W: the
        brute force of ``hf_kernel_attn.testing.check_kernel``. ``[B, N, Hq, Dv]``."""
        self.check_inputs(q, k, v, causal)
        scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
        b, hq, n, _ = q.shape
        hkv, m = k.shape[1], k.shape[-2]
        qn, kn = self.features(q, k, scaling)
        real = torch.ones(b, m, dtype=torch.bool, device=k.device) if key_mask is None else key_mask.to(torch.bool)
        window, count = self.options.window, self.options.sinks
        rank = real.long().cumsum(-1)
        sink = real & (rank <= count) if count else torch.zeros_like(real)
        beta, log_alpha = self.writes(dense(k), scaling, real & ~sink)
        vv = accum(v)
        if not window:
            out, _ = delta_rule_naive(queries_at_key_positions(qn, m), kn, vv, beta, log_alpha)
            return ungroup_output(out[..., m - n:, :]).to(q.dtype)
        _, _, states = delta_rule_naive(None, kn, vv, beta, log_alpha, return_states=True)  # [B, H, M, D, Dv]
        cum = torch.zeros_like(beta) if log_alpha is None else log_alpha.cumsum(-1)
        qg = group_queries(accum(q), hkv)
        mix = self.branch_mix(hkv, q.device)
        outs = []
        for i in range(n):
            p = m - n + i
            logits = scaling * (qg[:, :, :, i:i + 1] @ dense(k).transpose(-1, -2)[:, :, None])  # [B, H, G, 1, M]
            j = torch.arange(m, device=k.device)
            near = ((p - j) < window) & (j <= p)
            seen = real & (j <= p) & (near | sink)
            weights = torch.softmax(logits.masked_fill(~seen[:, None, None, None], float("-inf")), -1)
            weights = torch.nan_to_num(weights)  # a pad query that sees no key
            o = weights @ vv[:, :, None]  # [B, H, G, 1, Dv]
            t = p - window
            if t >= 0:
                far = (qn[:, :, :, i:i + 1] @ states[:, :, t, None]) * (cum[:, :, p] - cum[:, :, t]).exp()[
                    :, :, None, None, None]
                if mix is not None:
                    far = far * mix.to(far.dtype)[None, :, :, None, None]
                o = o + far
            outs.append(o)
        return ungroup_output(torch.cat(outs, 3)).to(q.dtype)

    def check_inputs(self, q, k, v, causal):
        if not causal:
            raise ValueError(
                f"kernel {self.name!r} is causal only (its delta-rule memory is a recurrence over the tokens in "
                f"order) and cannot run a bidirectional (encoder) layer; causal-only kernels: "
                f"{causal_only_kernels()}; for encoders choose another kernel")
        super().check_inputs(q, k, v, causal)

    def flops(self, n: int, *, batch: int, causal: bool, backward: bool) -> float:
        """The chunked form's matmuls: per chunk of C and KV head with G query heads, K Kᵀ (2C²D), the triangular
        solve for U' and W (C²(Dv + D)), W S (2CDDv), the in-chunk scores Q Kᵀ (2GC²D) times U (2GC²Dv), Q S
        (2GCDDv) and the memory update Kᵀ U (2CDDv); forward + backward = 3× (the benchmark's convention)."""
        s = self.shape
        dv = s.head_dim
        d = self.num_features()
        g = s.num_heads // s.num_kv_heads
        c = min(self.options.chunk_size, max(n, 1))
        chunks = -(-n // c)
        per_chunk = (2 * c * c * d + c * c * (d + dv) + 2 * c * d * dv + 2 * g * c * c * (d + dv)
                     + 2 * g * c * d * dv + 2 * c * d * dv)
        total = float(batch * s.num_kv_heads * chunks * per_chunk)
        if self.options.window:
            total += 2.0 * batch * s.num_heads * n * self.options.window * (s.head_dim + dv)
        total += 2.0 * batch * n * s.head_dim * self.projection_width() * (s.num_heads + s.num_kv_heads)
        return total * (3.0 if backward else 1.0)

    # -------------------------------------------------------------------------------------------- forms

    def feature_map_forward(self, q, k, v, call: AttentionCall):
        """The delta rule's memory (its own state: :attr:`packs_window_state` is False), alone or with the window."""
        args = (q, k, v, call.key_mask, call.scaling, call.state, call.offset)
        return self._delta_windowed(*args) if self.window else self._delta_causal(*args)


class GatedDeltaNetKernel(DeltaNetKernel):
    """Gated DeltaNet: the delta rule with a data-dependent decay α_t per KV head, GLA's low-rank gate from the keys'
    RoPE-pair norms (module docstring)."""

    name = "gated_deltanet"
    options_cls = GatedDeltaNetOptions
    paper = ("Yang, Kautz, Hatamizadeh, ICLR 2025, Gated Delta Networks: Improving Mamba2 with Delta Rule; "
             "chunked form: Yang et al., NeurIPS 2024")

    def __init__(self, shape: LayerShape, options: GatedDeltaNetOptions) -> None:
        super().__init__(shape, options)
        pairs = -(-shape.head_dim // 2)
        self.gate_down = nn.Parameter(torch.empty(shape.num_kv_heads, pairs, options.gate_rank))
        self.gate_up = nn.Parameter(torch.empty(shape.num_kv_heads, options.gate_rank, 1))
        self.gate_bias = nn.Parameter(torch.empty(shape.num_kv_heads, 1))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        reset_low_rank_gate(self.gate_down, self.gate_up, self.gate_bias, self.shape.layer_idx)

    def log_gate(self, k, scaling):
        return low_rank_log_gate(k, scaling, self.options.rope_pairs, self.gate_down, self.gate_up, self.gate_bias,
                                 self.options.gate_temperature)

    def gates(self, k, scaling):
        return clamp_log_gate(self.log_gate(accum(k), scaling))

    def gate_flops(self, n: int) -> float:
        heads, pairs, r = self.gate_down.shape
        return 2.0 * n * heads * (pairs * r + r)
