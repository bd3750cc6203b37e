"""The recurrent form: keys folded into a state (prefix keys, or one decode step).

    S ← S + Σ_j φ(k_j) v_jᵀ,  z ← z + Σ_j φ(k_j)

(with a decay, the gated engine's :func:`.gated.fold`).
"""

from __future__ import annotations

import torch

from ..base import accum
from .state import LinearState


def accumulate(fk: torch.Tensor, v: torch.Tensor, state: LinearState | None) -> LinearState:
    """Fold L keys into the state: S ← S + Σ_j φ(k_j) v_jᵀ, z ← z + Σ_j φ(k_j)."""
    if state is None:
        state = LinearState.zeros(fk, v.shape[-1])
    fk = accum(fk)
    v = accum(v)
    return LinearState(state.S + fk.transpose(-1, -2) @ v, state.z + fk.sum(-2))
