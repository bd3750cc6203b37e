"""What the window-hybrid forms (:mod:`.window`, :mod:`.gated`, :mod:`.sparse_cache`, :mod:`.window_decode`) are
given: the hybrid as its kernel's options define it (:class:`HybridSpec`), one call's state and flags
(:class:`HybridCall`) and the projected inputs (:class:`HybridInputs`), instead of a long list of parameters passed
along unchanged from one form to the next."""

from __future__ import annotations

import dataclasses

import torch

from .state import LinearState, SinkSet


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """A window hybrid: softmax (scale ``scaling``) over the last ``window`` keys and the first ``sinks`` real tokens,
    the feature map over older keys in chunks of ``chunk_size``; with ``capacity`` C > 0 a bounded sparse cache of C
    pairs per KV head chosen every ``block`` positions; ``eps`` the floor of a normaliser."""

    window: int
    scaling: float
    chunk_size: int = 64
    sinks: int = 0
    capacity: int = 0
    block: int = 16
    eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class HybridCall:
    """One call of a hybrid form: ``causal``; ``key_mask`` ``[B, M]`` (True = real) or None; ``state`` holding the
    keys before these (causal) and ``offset``, the position of the first of them; ``log_mix`` ln λ ``[Hkv, G]`` of
    the feature-map part (None: λ = 1); the ``sinks`` kept so far; whether the state after the keys is wanted
    (``need_state``); ``blocked``: bound temporaries (no autograd); ``raw``: the unnormalised sums instead of
    outputs (:func:`.window.hybrid_attention`)."""

    causal: bool = True
    key_mask: torch.Tensor | None = None
    state: LinearState | None = None
    offset: int = 0
    log_mix: torch.Tensor | None = None
    sinks: SinkSet | None = None
    need_state: bool = False
    blocked: bool = False
    raw: bool = False


CAUSAL_CALL = HybridCall()  # the defaults: causal, no mask, no state, λ = 1, no sinks


@dataclasses.dataclass(frozen=True)
class HybridInputs:
    """Queries grouped by KV head ``q`` ``[B, Hkv, G, N, D]``, keys ``k`` ``[B, Hkv, M, D]``, values ``v``
    ``[B, Hkv, M, Dv]`` and the features ``fq`` ``[B, Hkv, G, N, F]``, ``fk`` ``[B, Hkv, M, F]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fq: torch.Tensor
    fk: torch.Tensor
