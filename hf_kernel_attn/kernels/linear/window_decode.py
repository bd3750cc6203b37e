"""The window hybrid's decode step on packed buffers, with or without a bounded sparse cache: the rule of
:mod:`.window` and :mod:`.sparse_cache` for one query at a time once the prompt is behind (the fast path next to
the general forms, which stay the reference).

Once every sink slot is filled and out of every later window, every cache slot holds a pair and no key was
padding, nothing in a decode step needs a mask: query t weighs

    e^{s q_t·k_j}  over  [sinks | the W - 1 keys before t | the C cached pairs | k_t]   and   λ_h φ(q_t)·[S, z]

so one fused attention call over one buffer gives the softmax part and its log-sum-exp ℓ, and the output is
(o + w φ(q)ᵀS) / (1 + w φ(q)ᵀz) with w = λ_h e^{-ℓ} (the general form's sums, both divided by e^{ℓ - m}); with
λ = 0 in every head (retrieval heads on a budget) it is scaled dot-product attention alone. Per (row, KV head) the
keys and values live in one buffer ``[B, Hkv, S + W - 1 + C, ·]``: the sinks, a ring of W - 1 slots (position p in
slot p mod (W - 1)) and the cache; [S, z] is one tensor ``[B, Hkv, F, Dv + 1]``. After the query the key leaving
the window (position t - W + 1) goes into the state and, with a cache, its pending slot (the general form's
``fold_to``), and k_t takes its ring slot; at a boundary (t a multiple of the block) the pool is re-chosen first by
:func:`.sparse_cache.choose_pairs`, the function the general form calls. The buffers hold exactly the tensors of
the general state (:class:`.state.LinearState` with its sinks and sparse cache, plus the W - 1 window keys), so the
decode cache's bytes are the same in both layouts and :func:`unpack` gives the general state back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .sparse_cache import choose_pairs
from .spec import HybridSpec
from .state import LinearState, SinkSet, SparseCache, with_ones


@dataclasses.dataclass
class PackedWindowState:
    """The decode state of one window-hybrid layer in the packed layout (module docstring): ``keys``
    ``[B, Hkv, S + W - 1 + C, D]`` and ``values`` (sinks, ring, cache), ``s`` = [S, z] ``[B, Hkv, F, Dv + 1]``, the
    sinks' and the cache's bookkeeping and the pending keys of :class:`.state.SparseCache` (None without a cache);
    ``position``: the next token's."""

    keys: torch.Tensor
    values: torch.Tensor
    s: torch.Tensor
    cache_pos: torch.Tensor | None
    cache_valid: torch.Tensor | None
    pending_keys: torch.Tensor | None
    pending_values: torch.Tensor | None
    pending_pos: torch.Tensor | None
    pending_ok: torch.Tensor | None
    sink_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # pos, valid, real_seen at packing
    num_sinks: int
    ring: int
    position: int
    packed_at: int
    folded: int  # the state holds every pending key at a position ≤ this (later ones wait for the boundary)
    synced: int  # the pending slots' positions and flags are written for the keys at positions ≤ this
    # φ of keys [B, Hkv, L, D] at positions [L] (None: any, for the cache's pairs, which need a position-free map)
    feature_k: Callable[..., torch.Tensor]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedWindowState:
        """The same state with ``fn`` applied to every per-row tensor (beam reorder, batch select)."""
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        meta = None if self.sink_meta is None else tuple(fn(t) for t in self.sink_meta)
        return dataclasses.replace(
            self, keys=fn(self.keys), values=fn(self.values), s=fn(self.s), cache_pos=opt(self.cache_pos),
            cache_valid=opt(self.cache_valid), pending_keys=opt(self.pending_keys),
            pending_values=opt(self.pending_values), pending_ok=opt(self.pending_ok), sink_meta=meta)

    @property
    def capacity(self) -> int:
        return 0 if self.cache_pos is None else self.cache_pos.shape[-1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the state holds (the bytes of the decode cache): the same tensors as the general layout's."""
        meta = () if self.sink_meta is None else self.sink_meta
        held = (self.keys, self.values, self.s, self.cache_pos, self.cache_valid, self.pending_keys,
                self.pending_values, self.pending_pos, self.pending_ok, *meta)
        return tuple(t for t in held if t is not None)


def can_pack(state: LinearState | None, window_keys: torch.Tensor | None, *, window: int, sinks: int,
             capacity: int, position: int, block: int = 1) -> bool:
    """Whether a general decode state (after ``position`` tokens, all real) can go to the packed layout: the cache
    (``capacity`` C pairs) full, the window's W - 1 keys kept, every sink filled and out of the next query's window,
    float32 or float64, no exact heads' growing K/V; with a cache, its ring of pending slots grown to the block's
    B slots (caches grow with use: :class:`.state.SparseCache`)."""
    if state is None or state.exact is not None or state.S.dtype not in (torch.float32, torch.float64):
        return False
    if (state.sparse is None) != (capacity == 0):
        return False
    held = [*([] if state.sparse is None else [state.sparse.keys]), *([] if window_keys is None else [window_keys]),
            *([] if state.sinks is None else [state.sinks.keys])]
    if any(t.dtype != state.S.dtype for t in held):  # the buffers keep the dtype (and so the bytes) they had
        return False
    if window > 1 and (window_keys is None or window_keys.shape[-2] != window - 1):
        return False
    if sinks:
        if state.sinks is None or state.sinks.keys.shape[-2] != sinks or not bool(state.sinks.valid.all()):
            return False
        if int(state.sinks.pos.max()) > position - window:
            return False
    if state.sparse is None:
        return True
    sc = state.sparse
    return sc.keys.shape[-2] == capacity and sc.pending_pos.shape[0] == block and bool(sc.valid.all())


def pack(state: LinearState, window_keys: torch.Tensor | None, window_values: torch.Tensor | None,
         feature_k: Callable[..., torch.Tensor], *, window: int, position: int) -> PackedWindowState:
    """The packed layout of a general decode state (:func:`can_pack`) whose window keys are the W - 1 before
    ``position`` in order; ``feature_k(keys, positions=None)`` the kernel's φ of keys."""
    dtype = state.S.dtype
    sc = state.sparse
    ring = window - 1
    parts_k, parts_v = [], []
    meta = None
    if state.sinks is not None:
        parts_k.append(state.sinks.keys.to(dtype))
        parts_v.append(state.sinks.values.to(dtype))
        meta = (state.sinks.pos, state.sinks.valid, state.sinks.real_seen)
    if ring:
        shift = (position - ring) % ring  # window key i sits at position - ring + i, in slot (that) mod ring
        parts_k.append(window_keys.to(dtype).roll(shift, 2))
        parts_v.append(window_values.to(dtype).roll(shift, 2))
    cache: tuple[torch.Tensor | None, ...] = (None,) * 6
    if sc is not None:
        parts_k.append(sc.keys.to(dtype))
        parts_v.append(sc.values.to(dtype))
        cache = (sc.pos.clone(), sc.valid.clone(), sc.pending_keys.to(dtype).clone(),
                 sc.pending_values.to(dtype).clone(), sc.pending_pos.clone(), sc.pending_ok.clone())
    return PackedWindowState(
        torch.cat(parts_k, 2), torch.cat(parts_v, 2), torch.cat([state.S, state.z.unsqueeze(-1)], -1), *cache, meta,
        0 if state.sinks is None else state.sinks.keys.shape[-2], ring, position, position, position - window,
        position - window, feature_k)


def unpack(packed: PackedWindowState) -> tuple[LinearState, torch.Tensor | None, torch.Tensor | None]:
    """The general state, with the W - 1 window keys and values in position order (None for W = 1)."""
    ns, ring, t = packed.num_sinks, packed.ring, packed.position
    dv = packed.values.shape[-1]
    sinks = None
    if packed.sink_meta is not None:
        pos, valid, real_seen = packed.sink_meta
        steps = t - packed.packed_at  # every token since packing was real (a condition of packing)
        sinks = SinkSet(packed.keys[:, :, :ns], packed.values[:, :, :ns], pos, valid, real_seen + steps, t)
    wk = wv = None
    if ring:
        shift = (t - ring) % ring
        wk = packed.keys[:, :, ns:ns + ring].roll(-shift, 2)
        wv = packed.values[:, :, ns:ns + ring].roll(-shift, 2)
    sparse = None
    if packed.capacity:
        c0 = ns + ring
        _settle_pending(packed, t - 1 - ring)
        sparse = SparseCache(packed.keys[:, :, c0:], packed.values[:, :, c0:], packed.cache_pos, packed.cache_valid,
                             packed.pending_keys, packed.pending_values, packed.pending_pos, packed.pending_ok)
    return LinearState(packed.s[..., :dv], packed.s[..., dv], sinks, sparse=sparse), wk, wv


def _settle_pending(packed: PackedWindowState, through: int, fold: bool = True) -> None:
    """Bring the pending slots up to date for the keys that left the window at positions ≤ ``through``: their slots'
    positions and flags (decode steps write only the slots' keys and values; every key since packing was real and no
    sink, a condition of packing) and, with ``fold``, the fold into the state of those a step left out of it (no
    feature-map part)."""
    if through > packed.synced:
        n = packed.pending_pos.shape[0]
        left = torch.arange(max(packed.synced + 1, through + 1 - n), through + 1, device=packed.pending_pos.device)
        slots = left % n
        packed.pending_pos.index_copy_(0, slots, left)
        packed.pending_ok.index_fill_(1, slots, True)
        packed.synced = through
    if fold and through > packed.folded:
        due = packed.pending_ok & (packed.pending_pos > packed.folded) & (packed.pending_pos <= through)  # [B, P]
        fk = packed.feature_k(packed.pending_keys) * due[:, None, :, None].to(packed.s.dtype)
        packed.s = packed.s + fk.transpose(-1, -2) @ with_ones(packed.pending_values)
        packed.folded = through


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_j(s q·k_j) v_j ``[B, Hkv, G, Dv]`` and log Σ_j e^{s q·k_j} ``[B, Hkv, G, 1]``: on CPU from one fused
    kernel (the flash-attention kernel behind ``scaled_dot_product_attention``, which returns the log-sum-exp
    too), elsewhere written out."""
    if (q.device.type == "cpu" and _FLASH_CPU is not None and q.dtype in (torch.float32, torch.float64)
            and keys.shape[-1] == values.shape[-1]):  # (that kernel wants one head size for q, k and v)
        out, lse = _FLASH_CPU(q, keys, values, 0.0, False, scale=scaling)[:2]
        return out, lse.unsqueeze(-1)
    logits = (q @ keys.transpose(-1, -2)) * scaling
    lse = logits.logsumexp(-1, keepdim=True)
    return (logits - lse).exp() @ values, lse


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def decode_step(
    packed: PackedWindowState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_q: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    spec: HybridSpec,
    log_mix: torch.Tensor | None,
    linear: bool,
) -> torch.Tensor:
    """The output ``[B, Hkv, G, Dv]`` of query ``q`` ``[B, Hkv, G, D]`` (grouped) at ``packed.position``, with its
    key and value ``k`` / ``v`` ``[B, Hkv, 1, ·]``; ``packed`` is updated in place to the next position.
    ``feature_q(q, positions)``: φ of ``[B, Hkv, G, 1, D]`` queries (of keys: ``packed.feature_k``);
    ``spec``: the scale, the block and eps; ``log_mix`` ln λ ``[Hkv, G]`` or None (λ = 1); ``linear`` False when
    λ = 0 in every head (no feature-map part: the keys leaving the window then wait in their pending slots and join
    the state at the next boundary, in one matmul).

    With the softmax part's log-sum-exp ℓ = log Σ_j e^{s q·k_j} and its output o, the hybrid's output is
    (o + w φ(q)ᵀS) / (1 + w φ(q)ᵀz), w = λ e^{-ℓ}: the general form's sums divided by e^{ℓ - m}."""
    t = packed.position
    scaling, block = spec.scaling, spec.block
    dtype = packed.s.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    dv = v.shape[-1]
    ring = packed.ring
    c0 = packed.num_sinks + ring
    capacity = packed.capacity
    if capacity and t % block == 0:  # a boundary: the pool is re-chosen before query t is answered
        # the candidates (positions after t - B - W) all wait outside the state, or it takes in those that wait
        waiting = packed.folded <= t - block - 1 - ring
        _settle_pending(packed, t - 1 - ring, fold=not waiting)
        pool = SparseCache(packed.keys[:, :, c0:], packed.values[:, :, c0:], packed.cache_pos, packed.cache_valid,
                           packed.pending_keys, packed.pending_values, packed.pending_pos, packed.pending_ok)
        s, ck, cv, pos, valid = choose_pairs(packed.s, pool, packed.feature_k, capacity=capacity, eps=spec.eps,
                                             in_state=not waiting)
        packed.folded = t - 1 - ring
        packed.keys[:, :, c0:] = ck
        packed.values[:, :, c0:] = cv
        packed.s, packed.cache_pos, packed.cache_valid = s, pos, valid
        packed.pending_ok.zero_()
    keys = torch.cat([packed.keys, k], 2)
    values = torch.cat([packed.values, v], 2)
    if not linear:
        out = F.scaled_dot_product_attention(q, keys, values, scale=scaling)
    else:
        soft, lse = _attend(q, keys, values, scaling)
        at = torch.full((1,), t, dtype=torch.long, device=q.device)
        far = feature_q(q.unsqueeze(3), at).squeeze(3) @ packed.s  # [B, Hkv, G, Dv + 1]
        w = (-lse).exp() if log_mix is None else (log_mix.unsqueeze(-1) - lse).exp()
        out = torch.addcmul(soft, far[..., :dv], w) / (far[..., dv:] * w).add_(1)  # φ ≥ 0: the divisor is ≥ 1
    # the key leaving the window (position t - W + 1) goes to its pending slot (and, with a feature-map part or
    # without a cache, into the state at once); k_t takes its ring slot
    if ring:
        slot = packed.num_sinks + t % ring
        leaving_k, leaving_v = packed.keys.narrow(2, slot, 1), packed.values.narrow(2, slot, 1)
    else:
        leaving_k, leaving_v = k, v
    if capacity:
        p = (t - ring) % block
        packed.pending_keys.narrow(2, p, 1).copy_(leaving_k)
        packed.pending_values.narrow(2, p, 1).copy_(leaving_v)
    if linear or not capacity:
        at = torch.full((1,), t - ring, dtype=torch.long, device=k.device)
        fk = packed.feature_k(leaving_k, at).transpose(-1, -2)  # [B, Hkv, F, 1]
        packed.s[..., :dv].addcmul_(fk, leaving_v)
        packed.s[..., dv:].add_(fk)
        packed.folded = t - ring
    if ring:
        leaving_k.copy_(k)
        leaving_v.copy_(v)
    packed.position = t + 1
    return out
