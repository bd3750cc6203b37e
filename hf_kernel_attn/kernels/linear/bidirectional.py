"""The bidirectional form: every query sees every (unmasked) key, O(N): one global state

    out_i = φ(q_i)ᵀ S / max(φ(q_i)ᵀ z, eps),  S = Σ_j φ(k_j) v_jᵀ,  z = Σ_j φ(k_j)

or, with a decay, weights γ^|i-j| from two causal scans (:func:`.chunk.causal_chunked`, forwards and backwards).
"""

from __future__ import annotations

import torch

from ..base import accum
from .chunk import DEFAULT_CHUNK, causal_chunked
from .recurrent import accumulate


def bidirectional(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query sees every (unmasked) key; with a decay the weight is γ^|i-j| (two causal scans)."""
    fq, fk, v = accum(fq), accum(fk), accum(v)
    if log_decay is None:
        s = fk.transpose(-1, -2) @ v  # [B, H, F, Dv]
        z = fk.sum(-2)  # [B, H, F]
        return fq @ s.unsqueeze(2), (fq @ z[:, :, None, :, None]).squeeze(-1)
    # N <= M queries sit at the last N key positions: keys before them form a decayed prefix state
    prefix = fk.shape[-2] - fq.shape[-2]
    state = accumulate(fk[:, :, :prefix], v[:, :, :prefix], None, log_decay) if prefix > 0 else None
    fk, v = fk[:, :, prefix:], v[:, :, prefix:]
    num_f, den_f, _ = causal_chunked(fq, fk, v, state=state, log_decay=log_decay, chunk_size=chunk_size)
    num_b, den_b, _ = causal_chunked(fq.flip(-2), fk.flip(-2), v.flip(-2), log_decay=log_decay,
                                     chunk_size=chunk_size)
    diag = (fq * fk.unsqueeze(2)).sum(-1)  # [B, H, G, N]: the j = i term, counted by both scans
    return num_f + num_b.flip(-2) - diag.unsqueeze(-1) * v.unsqueeze(2), den_f + den_b.flip(-1) - diag
