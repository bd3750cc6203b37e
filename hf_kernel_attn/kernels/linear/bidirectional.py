"""The bidirectional form: every query sees every (unmasked) key, O(N): one global state

    out_i = φ(q_i)ᵀ S / max(φ(q_i)ᵀ z, eps),  S = Σ_j φ(k_j) v_jᵀ,  z = Σ_j φ(k_j)

(with a decay, two gated scans: :func:`.gated.gated_linear`).
"""

from __future__ import annotations

import torch

from ..base import accum


def bidirectional(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query sees every (unmasked) key: numerator ``[B, H, G, N, Dv]`` and denominator ``[B, H, G, N]``."""
    fq, fk, v = accum(fq), accum(fk), accum(v)
    s = fk.transpose(-1, -2) @ v  # [B, H, F, Dv]
    z = fk.sum(-2)  # [B, H, F]
    return fq @ s.unsqueeze(2), (fq @ z[:, :, None, :, None]).squeeze(-1)
