"""What every feature-map kernel takes and shares at the ground floor of :mod:`.`: the options
(:class:`LinearOptions`), one call's arguments as the forms pass them on (:class:`AttentionCall`), and two small
helpers (:func:`dense`, :func:`layer_generator`)."""

from __future__ import annotations

import dataclasses

import torch

from .. import linear
from ..base import EPS_RANGE, MAX_TOKENS, KernelOptions, accum, integer_in, number_in, one_of, option
from ..linear.state import LinearState


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


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call's arguments besides q, k and v, as :meth:`.base.LinearKernel.forward_with_state` hands them
    to the forms: ``key_mask`` ``[B, M]`` (True = real) or None, ``causal``, ``scaling`` (the softmax scale), the
    ``state`` after the keys before these (None at the start), ``offset`` (how many keys came before) and whether a
    state must come back (``need_state``)."""

    key_mask: torch.Tensor | None
    causal: bool
    scaling: float
    state: LinearState | None
    offset: int
    need_state: bool
