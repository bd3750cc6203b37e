"""The recurrent form: keys folded into a state (prefix keys, or one decode step).

    S ← γ^L S + Σ_j γ^(L-j) φ(k_j) v_jᵀ,  z ← γ^L z + Σ_j γ^(L-j) φ(k_j)  (j = 0..L-1)
"""

from __future__ import annotations

import torch

from ..base import accum
from .state import LinearState, decay_powers


def accumulate(
    fk: torch.Tensor, v: torch.Tensor, state: LinearState | None, log_decay: torch.Tensor | None = None
) -> LinearState:
    """Fold L keys into the state: S ← γ^L S + Σ_j γ^(L-j) φ(k_j) v_jᵀ (j = 0..L-1)."""
    if state is None:
        state = LinearState.zeros(fk, v.shape[-1])
    fk = accum(fk)
    v = accum(v)
    length = fk.shape[-2]
    if log_decay is None:
        return LinearState(state.S + fk.transpose(-1, -2) @ v, state.z + fk.sum(-2))
    exps = torch.arange(length, 0, -1, device=fk.device, dtype=fk.dtype)
    log_decay = log_decay.to(fk.dtype)
    w = decay_powers(log_decay, exps)[None, :, :, None]  # [1, H, L, 1]
    carry = torch.exp(log_decay * length)[None, :, None]  # [1, H, 1]
    fkw = fk * w
    return LinearState(state.S * carry[..., None] + fkw.transpose(-1, -2) @ v, state.z * carry + fkw.sum(-2))
