"""A learnable per-head map on q and k in front of a kernel, identity-initialised (so a swap starts as
the plain kernel): ``diagonal`` scales each coordinate (the ARD Gaussian's per-dimension bandwidths;
QK-norm's per-dimension gains), ``full`` is a d×d matrix per head, like Hedgehog's learnable feature
map (Zhang et al., ICLR 2024) placed before a fixed kernel. Attention transfer trains it."""

from __future__ import annotations

import torch
from torch import nn

PROJECTIONS = ("none", "diagonal", "full")


class QKProjection(nn.Module):
    """q_h -> q_h A_h, k_g -> k_g B_g (``full``) or q ⊙ a_h, k ⊙ b_g (``diagonal``), per query head h
    and KV head g."""

    def __init__(self, mode: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if mode not in PROJECTIONS[1:]:
            raise ValueError(f"projection must be one of {list(PROJECTIONS)}, got {mode!r}")
        self.mode = mode
        shape = (head_dim, head_dim) if mode == "full" else (head_dim,)
        self.q = nn.Parameter(torch.empty(num_heads, *shape))
        self.k = nn.Parameter(torch.empty(num_kv_heads, *shape))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in (self.q, self.k):
                if self.mode == "full":
                    p.copy_(torch.eye(p.shape[-1]).expand_as(p))
                else:
                    p.fill_(1.0)

    def _map(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.to(x.dtype)
        if self.mode == "full":
            return torch.einsum("bhnd,hde->bhne", x, w)
        return x * w[None, :, None, :]

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[1] != self.q.shape[0] or k.shape[1] != self.k.shape[0]:
            raise ValueError(f"projection built for {self.q.shape[0]}/{self.k.shape[0]} heads, got "
                             f"{q.shape[1]}/{k.shape[1]}")
        return self._map(q, self.q), self._map(k, self.k)
