"""Slots of a bounded cache: the attention sinks (the first S real tokens of each row), slots that grow with use
instead of being allocated up front, and the gathers that fill them. Shared by the windowed softmax, the feature-map
hybrids and the retention cache."""

from __future__ import annotations

import torch


def sink_slots(real: torch.Tensor, sinks: int, offset: int = 0, seen: torch.Tensor | None = None):
    """The sinks among keys with real flags ``real`` ``[B, M]`` at positions offset, offset + 1, …:
    for slot s < S, the key whose rank among the row's real tokens (counting ``seen`` [B] earlier real tokens)
    is s + 1. Returns (index into the M keys ``[B, S]``, clamped to M - 1; position ``[B, S]``; found ``[B, S]``,
    False where that rank is not among these keys)."""
    b, m = real.shape
    rank = real.long().cumsum(-1)
    if seen is not None:
        rank = rank + seen[:, None]
    target = torch.arange(1, sinks + 1, device=real.device).expand(b, sinks)
    idx = torch.searchsorted(rank.contiguous(), target.contiguous())  # first key with rank >= s + 1
    found = idx < m
    if seen is not None:
        found = found & (target > seen[:, None])
    idx = idx.clamp_max(max(0, m - 1))
    return idx, idx + offset, found


def grow_slots(x: torch.Tensor, dim: int, size: int, fill: float | bool = 0) -> torch.Tensor:
    """``x`` extended along ``dim`` to ``size`` entries of ``fill`` (``x`` itself when it has as many): slots that
    grow with use instead of being allocated for a configured count up front."""
    extra = size - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, fill)], dim)


def sink_slot_count(sinks: int, positions: int) -> int:
    """The sink slots worth holding after ``positions`` keys: min(S, positions) (a slot is the key of one rank among
    the real tokens, so no more can be filled yet)."""
    return min(sinks, positions)


def gather_keys(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, M, D]``, ``idx`` ``[B, S]`` -> ``[B, H, S, D]``."""
    b, h, _, d = x.shape
    return x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d))
