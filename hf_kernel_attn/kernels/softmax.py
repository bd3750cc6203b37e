"""Softmax attention: the exponential kernel exp(s <q, k>) normalised over the context.

This is the reference every other kernel is compared to (Vaswani et al., 2017); it runs through
torch's fused ``scaled_dot_product_attention`` (SDPA) without repeating K/V for GQA.

Options ``window`` / ``sinks`` restrict it to a sliding window plus attention sinks:

    out_i = Σ_{j∈vis(i)} e^{s q_i·k_j} v_j / Σ_{j∈vis(i)} e^{s q_i·k_j},
    vis(i) = {j real : p_i - W < j ≤ p_i} ∪ {j ∈ sinks : j ≤ p_i}          (causal)
    vis(i) = {j real : |p_i - j| < W} ∪ sinks                                 (bidirectional)

with p_i = i + M - N (bottom-right alignment, the same window as the feature-map hybrid in ``linear/window.py``)
and ``sinks`` the first S real (``key_mask`` True) keys of each row (StreamingLLM: Xiao et al., ICLR 2024,
"Efficient Streaming Language Models with Attention Sinks"). Positions are not re-indexed: the model's
own (RoPE) positions stay as they are; the window only decides which keys are visible. Queries are cut into
chunks of C; a chunk attends to its band of keys [start - W + 1, end] (… end + W - 1 bidirectionally) plus the
S sinks through SDPA with a small bool mask, so the cost is O(N·(W + C + S)); nothing N × M is built.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .base import (
    MAX_TOKENS,
    Kernel,
    KernelOptions,
    LayerShape,
    expand_kv,
    integer_in,
    number_in,
    one_of,
    option,
    visibility_mask,
)
from .retention import (
    RetentionBudget,
    RetentionGate,
    RetentionState,
    retention_attention,
    soft_retention_attention,
)
from .slots import gather_keys, sink_slot_count, sink_slots

RETENTION_SCORES = ("learned",)  # the scores that can decide the slots

# queries per SDPA call of the windowed form: C = W clamped to [MIN_QUERY_CHUNK, QUERY_CHUNK]
QUERY_CHUNK = 256
MIN_QUERY_CHUNK = 64


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q kᵀ + bias + mask) v through SDPA (``bias`` an additive float ``[B or 1, Hq, N, M]``);
    returns ``[B, N, Hq, Dv]``."""
    n, m = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if bias is not None:
        vis = visibility_mask(key_mask, n, m, causal, q.device)
        float_mask = bias.to(q.dtype)
        if vis is not None:
            float_mask = float_mask.masked_fill(~vis, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=scale, dropout_p=dropout,
                                             enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()
    if key_mask is None and (not causal or n == m or n == 1):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and n == m and n > 1, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
    else:
        mask = visibility_mask(key_mask, n, m, causal, q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous()


def query_chunk(window: int, n: int) -> int:
    """C: W clamped to [MIN_QUERY_CHUNK, QUERY_CHUNK] (and to N)."""
    return max(1, min(n, max(MIN_QUERY_CHUNK, min(window, QUERY_CHUNK))))


@dataclasses.dataclass(frozen=True)
class WindowBand:
    """The band of a sliding-window softmax call: window W, softmax scale s, ``causal``; the queries sit at
    positions q_start, q_start + 1, … and the keys at k_start, k_start + 1, …; ``dropout`` p on the weights."""

    window: int
    scale: float
    causal: bool = True
    q_start: int = 0
    k_start: int = 0
    dropout: float = 0.0


@dataclasses.dataclass(frozen=True)
class SinkKeys:
    """The attention sinks a band attends besides its window: ``keys`` ``[B, Hkv, S, D]``, ``values``
    ``[B, Hkv, S, Dv]`` at positions ``pos`` ``[B, S]``, ``valid`` ``[B, S]`` (slot filled)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    band: WindowBand,
    *,
    key_real: torch.Tensor | None = None,
    sinks: SinkKeys | None = None,
) -> torch.Tensor:
    """Sliding-window softmax (module docstring) for queries ``q`` ``[B, Hq, N, D]`` at positions
    band.q_start … band.q_start + N - 1 and keys ``k``/``v`` ``[B, Hkv, M, ·]`` at positions band.k_start …
    band.k_start + M - 1 (``key_real`` ``[B, M]``, None = all real), which must hold every key inside any query's
    window. ``sinks`` are attended by the queries whose window they are outside of (inside it they are among ``k``):
    each key counts once. Returns ``[B, N, Hq, Dv]``. Rows with no visible key are opened to their whole band
    (finite, unused)."""
    b, hq, n, _ = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    window, causal, q_start, k_start = band.window, band.causal, band.q_start, band.k_start
    gqa = hq != k.shape[1]
    out = q.new_empty(b, n, hq, dv)
    c = query_chunk(window, n)
    has_sinks = sinks is not None and sinks.keys.shape[-2] > 0
    for a in range(0, n, c):
        e = min(n, a + c)
        first, last = q_start + a, q_start + e - 1  # positions of the chunk's queries
        lo = max(0, first - window + 1 - k_start)
        hi = min(m, (last if causal else last + window - 1) + 1 - k_start)
        qpos = torch.arange(first, last + 1, device=q.device)
        d = qpos[:, None] - torch.arange(k_start + lo, k_start + hi, device=q.device)[None, :]
        mask = ((d >= 0) & (d < window) if causal else d.abs() < window)[None, None]  # [1, 1, C, K]
        if key_real is not None:
            mask = mask & key_real[:, None, None, lo:hi]
        keys, values = k[:, :, lo:hi], v[:, :, lo:hi]
        if has_sinks:
            ds = qpos[None, :, None] - sinks.pos[:, None, :]  # [B, C, S]
            outside = ds >= window if causal else ds.abs() >= window
            sink_mask = (outside & sinks.valid[:, None, :])[:, None]
            mask = torch.cat([sink_mask, mask.expand(b, 1, e - a, hi - lo)], -1)
            keys, values = torch.cat([sinks.keys, keys], -2), torch.cat([sinks.values, values], -2)
        mask = mask | ~mask.any(-1, keepdim=True)
        o = F.scaled_dot_product_attention(q[:, :, a:e], keys, values, attn_mask=mask, scale=band.scale,
                                           dropout_p=band.dropout, enable_gqa=gqa)
        out[:, a:e] = o.transpose(1, 2)
    return out


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    options: SoftmaxOptions,
    key_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Sliding-window softmax (window W = ``options.window``) with ``options.sinks`` attention sinks over every key
    (positions 0 … M - 1, queries at the last N of them); returns ``[B, N, Hq, Dv]``."""
    n, m = q.shape[-2], k.shape[-2]
    sinks = None
    if options.sinks:
        real = torch.ones(q.shape[0], m, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
        idx, pos, found = sink_slots(real, sink_slot_count(options.sinks, m))
        sinks = SinkKeys(gather_keys(k, idx), gather_keys(v, idx), pos, found)
    band = WindowBand(options.window, scale, causal, q_start=m - n, k_start=0, dropout=dropout)
    return banded_attention(q, k, v, band, key_real=None if key_mask is None else key_mask.bool(), sinks=sinks)


def _count(name: str, value: object, meaning: str) -> None:
    integer_in(name, value, 0, MAX_TOKENS, meaning=meaning)


@dataclasses.dataclass
class SoftmaxOptions(KernelOptions):
    window: int = option(0, "W > 0: each query attends only to the keys within W positions of it (sliding "
                            "window); 0 = the whole context", bound="tokens")
    sinks: int = option(0, "S > 0 (needs a window): the first S real tokens of each row are always attended "
                           "(StreamingLLM)", bound="tokens")
    slots: int = option(0, "C > 0 (needs a window): besides sinks and window, each KV head keeps the C older keys "
                           "its retention score ranks highest (a bounded cache; kernels/retention.py)",
                        bound="tokens")
    retention: str = option("learned", "the score that decides the slots: learned (a gate per KV head, trained by "
                                       "the retention stage; TRIM-KV)")
    retention_decay: bool = option(True, "true: a key's score is ln β decayed with its age, (t - p) ln β (TRIM-KV; "
                                         "the retention stage's objective kl); false: ln β alone, fixed when the "
                                         "key is created (a keep score; the objective attention trains it)")
    retention_block: int = option(32, "B: the slots are decided every B positions (one eviction per block of "
                                      "queries in a prefill)", bound="tokens")
    gate_hidden: int = option(16, "hidden width of the retention gate's MLP per KV head")
    gate_bias: float = option(6.0, "the gate's output bias at the start: ln β = ln σ(6) ≈ -2.5e-3 for every key "
                                   "(all fade alike: the score is then the age)")

    def validate(self) -> None:
        _count("window", self.window, "0 = the whole context, W > 0 = a sliding window of W keys")
        _count("sinks", self.sinks, "the first S real tokens attended by every query; 0 = none")
        _count("slots", self.slots, "older keys kept by the retention score; 0 = none")
        if self.sinks and not self.window:
            raise ValueError(f"sinks={self.sinks} needs a window > 0 (window=0 attends to every key already); "
                             "set window=W as well, or sinks=0")
        if self.slots and not self.window:
            raise ValueError(f"slots={self.slots} needs a window > 0 (window=0 keeps every key already); "
                             "set window=W as well, or slots=0")
        one_of("retention", self.retention, RETENTION_SCORES)
        integer_in("retention_block", self.retention_block, 1, 4096, meaning="positions between two evictions")
        integer_in("gate_hidden", self.gate_hidden, 1, 1024, meaning="the retention gate's hidden width")
        number_in("gate_bias", self.gate_bias, -50.0, 50.0, meaning="the retention gate's starting output bias")

    def budget(self) -> RetentionBudget:
        return RetentionBudget(window=self.window, sinks=self.sinks, slots=self.slots, block=self.retention_block,
                               decay=self.retention_decay)


class SoftmaxKernel(Kernel):
    """softmax(s q kᵀ) v — the pretrained model's own attention; with ``window`` W > 0 over the keys j with
    p_i - W < j ≤ p_i (|p_i - j| < W bidirectionally) plus the first ``sinks`` real tokens (StreamingLLM)."""

    name = "softmax"
    options_cls = SoftmaxOptions
    full_precision = False  # the host's own attention, autocast included
    supports_bias = True
    paper = ("Vaswani et al., 2017, Attention Is All You Need; sinks: Xiao et al., 2024, StreamingLLM; "
             "slots: Bui et al., 2025, TRIM-KV")

    def __init__(self, shape: LayerShape, options: SoftmaxOptions) -> None:
        super().__init__(shape, options)
        self.retention_gate = None
        if options.slots:
            self.retention_gate = RetentionGate(shape.num_kv_heads, shape.head_dim, shape.head_dim,
                                                options.gate_hidden, options.gate_bias)

    def reset_parameters(self) -> None:
        if self.retention_gate is not None:
            self.retention_gate.reset_parameters(torch.Generator().manual_seed(7_000_003 + self.shape.layer_idx))

    @property
    def slots(self) -> int:
        return self.options.slots

    def retention_step(self, q, k, v, *, key_real, scaling, state: RetentionState | None):
        """The slots' hard budget for N new queries and keys after ``state`` (a cache's; None = from the start):
        returns ``[B, N, Hq, Dv]`` and the state after them."""
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        return retention_attention(q, k, v, self.retention_gate(k, v), budget=self.options.budget(),
                                   key_real=key_real, scale=scale, state=state)

    def log_scores(self, q, k, scaling):
        """log κ = s q·k."""
        return scaling * q @ expand_kv(k, q.shape[1]).transpose(-1, -2)

    @property
    def window(self) -> int:
        return self.options.window

    @property
    def sinks(self) -> int:
        return self.options.sinks

    def forward(self, q, k, v, *, key_mask=None, causal=True, scaling=None, dropout=0.0, bias=None):
        self.check_inputs(q, k, v, causal)
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        if self.slots:
            if bias is not None or not causal:
                raise ValueError("softmax with slots is a causal decoder's bounded cache: no position bias, no "
                                 "bidirectional layers; use slots=0")
            if self.training:  # soft retention (the retention stage trains the gate)
                return soft_retention_attention(q, k, v, self.retention_gate(k, v), budget=self.options.budget(),
                                                key_mask=key_mask, scale=scale)
            if q.shape[-2] != k.shape[-2]:
                raise ValueError("softmax with slots answers queries at every key position (a prefill); cached "
                                 "decoding goes through hf_kernel_attn's cache (RecurrentStateCache)")
            return self.retention_step(q, k, v, key_real=key_mask, scaling=scaling, state=None)[0]
        if not self.window or self.window >= k.shape[-2]:  # the window covers every key: plain softmax
            return fused_attention(q, k, v, key_mask=key_mask, causal=causal, scale=scale, dropout=dropout,
                                   bias=bias)
        if bias is not None:
            raise ValueError("softmax with a window takes no additive position bias; use window=0")
        return window_attention(q, k, v, options=self.options, key_mask=key_mask, causal=causal, scale=scale,
                                dropout=dropout)
