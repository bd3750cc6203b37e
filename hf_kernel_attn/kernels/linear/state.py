"""The state of linear attention and the row layouts its forms share.

    S_t = Σ_j w_tj φ(k_j) v_jᵀ,  z_t = Σ_j w_tj φ(k_j),  out = φ(q)ᵀ S / max(φ(q)ᵀ z, eps)

over the t keys seen so far (w_tj = 1, or the gates' decay e^{b_t - b_j} per feature, :mod:`.gated`, the state then
decayed to the last key it holds). ``S`` ``[B, Hkv, F, Dv]`` and ``z`` ``[B, Hkv, F]``; a windowed hybrid's sinks
(:class:`SinkSet`), a per-head hybrid's exact K/V (:class:`ExactKV`) and a bounded sparse cache
(:class:`SparseCache`) ride along. The denominator rides along
as an extra all-ones value column (:func:`with_ones`), so one matmul gives both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..base import accum


@dataclasses.dataclass
class SinkSet:
    """The attention sinks of a sinks + window hybrid: the first S real keys of each row (``keys``
    ``[B, Hkv, S, D]``, ``values`` ``[B, Hkv, S, Dv]``, absolute ``pos`` ``[B, S]``, ``valid`` ``[B, S]``: slot
    filled), ``real_seen`` ``[B]`` real keys seen so far and ``seen``, the keys seen (positions < seen)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    real_seen: torch.Tensor
    seen: int

    def holds(self, offset: int, m: int) -> torch.Tensor:
        """``[B, M]``: whether each of M keys at positions offset … offset + M - 1 is one of the row's sinks."""
        kpos = torch.arange(offset, offset + m, device=self.pos.device)
        return ((kpos[None, :, None] == self.pos[:, None, :]) & self.valid[:, None, :]).any(-1)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SinkSet:
        """The same sinks with ``fn`` applied to every per-row tensor (beam reorder, batch select)."""
        return SinkSet(fn(self.keys), fn(self.values), fn(self.pos), fn(self.valid), fn(self.real_seen), self.seen)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values, self.pos, self.valid, self.real_seen


@dataclasses.dataclass
class SparseCache:
    """The cache (``keys`` ``[B, Hkv, L, D]``, ``values`` ``[B, Hkv, L, Dv]``, absolute ``pos`` ``[B, Hkv, L]``,
    ``valid`` ``[B, Hkv, L]``: slot filled) and the pending keys, folded into the state since the last boundary and
    scored at the next one (``pending_keys`` ``[B, Hkv, P, D]``, ``pending_values``, slot = position mod B,
    ``pending_pos`` ``[P]``, ``pending_ok`` ``[B, P]``: a real, non-sink key in that slot).

    Both are sized by use: the cache has L = min(C, the pairs chosen so far) slots and the ring of pending slots
    P = min(B, the keys that left the window so far), so a large C or B costs nothing until that many keys have
    been seen; once they have, the sizes stay C and B (the same bytes at every later length)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    pending_keys: torch.Tensor
    pending_values: torch.Tensor
    pending_pos: torch.Tensor
    pending_ok: torch.Tensor

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor, capacity: int = 0, block: int = 0) -> SparseCache:
        """``capacity`` cache slots and ``block`` pending entries, unfilled (0 and 0: the cache before any key,
        grown as keys come)."""
        b, h, _, d = k.shape
        dv = v.shape[-1]
        long = dict(dtype=torch.long, device=k.device)
        flag = dict(dtype=torch.bool, device=k.device)
        return cls(k.new_zeros(b, h, capacity, d), v.new_zeros(b, h, capacity, dv), torch.zeros(b, h, capacity, **long),
                   torch.zeros(b, h, capacity, **flag), k.new_zeros(b, h, block, d), v.new_zeros(b, h, block, dv),
                   torch.full((block,), -1, **long), torch.zeros(b, block, **flag))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SparseCache:
        """The same cache with ``fn`` applied to every per-row tensor (beam reorder, batch select)."""
        return SparseCache(fn(self.keys), fn(self.values), fn(self.pos), fn(self.valid), fn(self.pending_keys),
                           fn(self.pending_values), self.pending_pos, fn(self.pending_ok))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.values, self.pos, self.valid, self.pending_keys, self.pending_values,
                self.pending_pos, self.pending_ok)


@dataclasses.dataclass
class ExactKV:
    """Every key/value seen so far of the KV heads that a layer's exact-softmax heads read (``keys``
    ``[B, Hs, T, D]``, ``values`` ``[B, Hs, T, Dv]``, ``real`` ``[B, T]``): the part of a per-head hybrid's cache
    that grows with the context."""

    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ExactKV:
        return ExactKV(fn(self.keys), fn(self.values), fn(self.real))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values, self.real


@dataclasses.dataclass
class LinearState:
    """Σ_j w_tj φ(k_j) v_jᵀ and Σ_j w_tj φ(k_j) over the t keys seen so far (the sinks of a
    sinks + window hybrid excluded; they ride along in ``sinks``, the exact heads' K/V in ``exact``, the pairs of a
    bounded sparse cache in ``sparse``)."""

    S: torch.Tensor
    z: torch.Tensor
    sinks: SinkSet | None = None
    exact: ExactKV | None = None  # per-head hybrids: the K/V of the exact-softmax heads' KV heads
    sparse: SparseCache | None = None  # a window hybrid's bounded sparse cache (.sparse_cache)

    @classmethod
    def zeros(cls, fk: torch.Tensor, dv: int) -> LinearState:
        b, h, _, f = fk.shape
        dtype = accum(fk).dtype
        return cls(fk.new_zeros(b, h, f, dv, dtype=dtype), fk.new_zeros(b, h, f, dtype=dtype))

    def augmented(self) -> torch.Tensor:
        """``[B·H, F, Dv + 1]``: S with z as its last column (the state of values extended by a 1)."""
        b, h, f, dv = self.S.shape
        return torch.cat([self.S, self.z.unsqueeze(-1)], -1).reshape(b * h, f, dv + 1)

    @classmethod
    def from_augmented(cls, s_aug: torch.Tensor, batch: int) -> LinearState:
        bh, f, dv1 = s_aug.shape
        s_aug = s_aug.view(batch, bh // batch, f, dv1)
        return cls(s_aug[..., :-1], s_aug[..., -1])



@dataclasses.dataclass(frozen=True)
class PastKeys:
    """What a causal call continues from: the ``state`` of the keys before its keys (None: there were none) and
    ``offset``, the position of its first key (how many keys came before it)."""

    state: LinearState | None = None
    offset: int = 0


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """``[..., Dv] -> [..., Dv + 1]``: values extended by a 1, so that one matmul also gives Σ φ(q)·φ(k)."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)


def query_rows(fq: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, N, F] -> [B·Hkv, N·G, F]``: the rows (position, query head in group) of :func:`scan`."""
    b, h, g, n, f = fq.shape
    return fq.transpose(2, 3).reshape(b * h, n * g, f)


def normalize(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    return num / den.clamp_min(eps).unsqueeze(-1)


def normalized_output(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / max(den, eps) for ``num`` ``[B, Hkv, G, N, Dv]``, in the attention output layout ``[B, N, Hq, Dv]``
    (query head h = kv · G + g); without autograd the division writes straight into that layout (one pass, one
    buffer: the same numbers as normalising, then reordering)."""
    b, h, g, n, dv = num.shape
    if torch.is_grad_enabled() and (num.requires_grad or den.requires_grad):
        return normalize(num, den, eps).reshape(b, h * g, n, dv).transpose(1, 2).contiguous()
    out = num.new_empty(b, n, h * g, dv)
    torch.div(num, den.clamp_min(eps).unsqueeze(-1), out=out.view(b, n, h, g, dv).permute(0, 2, 3, 1, 4))
    return out
