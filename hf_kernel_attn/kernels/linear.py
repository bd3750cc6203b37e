"""Linear (feature-map) attention: the three evaluation orders of one formula.

    out_i = φ(q_i)ᵀ S_i / max(φ(q_i)ᵀ z_i, eps),  S_i = Σ_j w_ij φ(k_j) v_jᵀ,  z_i = Σ_j w_ij φ(k_j)

with w_ij = 1 (j visible) or the decay γ^(i-j) (DiJiang), j ≤ i when causal
(Katharopoulos et al., ICML 2020, "Transformers are RNNs").

* :func:`bidirectional` — O(N): one global state.
* :func:`causal_chunked` — exact quadratic form inside a chunk of ``chunk_size`` queries, a running
  state across chunks; never builds an N×N matrix; fp32 accumulation.
* :func:`accumulate` — folds keys into a state (prefix keys, or one decode step).

Shapes: ``fq`` ``[B, Hkv, G, N, F]`` (query heads grouped by KV head), ``fk`` ``[B, Hkv, M, F]``,
``v`` ``[B, Hkv, M, Dv]``; ``log_decay`` ``[Hkv]`` (log γ ≤ 0) or None.
The state is ``S`` ``[B, Hkv, F, Dv]`` and ``z`` ``[B, Hkv, F]``, both decayed to the next position.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import accum

DEFAULT_CHUNK = 64


@dataclasses.dataclass
class LinearState:
    """Σ_j γ^(t-j) φ(k_j) v_jᵀ and Σ_j γ^(t-j) φ(k_j) over the t keys seen so far."""

    S: torch.Tensor
    z: torch.Tensor

    @classmethod
    def zeros(cls, fk: torch.Tensor, dv: int) -> LinearState:
        b, h, _, f = fk.shape
        dtype = accum(fk).dtype
        return cls(fk.new_zeros(b, h, f, dv, dtype=dtype), fk.new_zeros(b, h, f, dtype=dtype))


def _decay_powers(log_decay: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """γ^e per head: ``[H] x [...] -> [H, ...]`` computed as exp(e · ln γ) (never γ^(-m))."""
    return torch.exp(log_decay.view(-1, *([1] * exponents.dim())) * exponents)


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
    w = _decay_powers(log_decay, exps)[None, :, :, None]  # [1, H, L, 1]
    carry = torch.exp(log_decay * length)[None, :, None]  # [1, H, 1]
    fkw = fk * w
    return LinearState(state.S * carry[..., None] + fkw.transpose(-1, -2) @ v, state.z * carry + fkw.sum(-2))


def causal_chunked(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    state: LinearState | None = None,
    log_decay: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, LinearState]:
    """Causal numerator ``[B, H, G, N, Dv]`` and denominator ``[B, H, G, N]`` for N queries aligned with
    N keys that follow the keys already folded into ``state``; returns the final state too."""
    fq, fk, v = accum(fq), accum(fk), accum(v)
    n = fq.shape[-2]
    if state is None:
        state = LinearState.zeros(fk, v.shape[-1])
    chunk_size = min(chunk_size, n)  # a decode step (n = 1) needs 1×1 tables, not C×C
    nums, dens = [], []
    tril_full = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=fq.device).tril()
    if log_decay is not None:
        idx = torch.arange(chunk_size, device=fq.device, dtype=fq.dtype)
        diff = (idx[:, None] - idx[None, :]).clamp_min(0)
        log_decay = log_decay.to(fq.dtype)
        decay_full = _decay_powers(log_decay, diff) * tril_full  # [H, C, C]
        q_decay_full = _decay_powers(log_decay, idx)  # [H, C]
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        length = end - start
        qc = fq[..., start:end, :]
        kc = fk[:, :, start:end]
        vc = v[:, :, start:end]
        scores = qc @ kc.unsqueeze(2).transpose(-1, -2)  # [B, H, G, L, L]
        if log_decay is None:
            scores = scores * tril_full[:length, :length]
            q_inter = qc
        else:
            scores = scores * decay_full[None, :, None, :length, :length]
            q_inter = qc * q_decay_full[None, :, None, :length, None]
        nums.append(scores @ vc.unsqueeze(2) + q_inter @ state.S.unsqueeze(2))
        dens.append(scores.sum(-1) + (q_inter @ state.z[:, :, None, :, None]).squeeze(-1))
        state = accumulate(kc, vc, state, log_decay)
    return torch.cat(nums, -2), torch.cat(dens, -1), state


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


def normalize(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    return num / den.clamp_min(eps).unsqueeze(-1)
