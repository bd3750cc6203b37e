"""The delta rule as a token recurrence: the definition every faster form is checked against.

DeltaNet (Schlag, Irie, Schmidhuber, ICML 2021, "Linear Transformers Are Secretly Fast Weight Programmers") keeps a
fast-weight memory S that maps keys to values and, for each token, replaces what S returns for k_t by v_t to the
extent β_t (the delta rule), instead of only adding v_t k_tᵀ as linear attention does; Gated DeltaNet (Yang, Kautz,
Hatamizadeh, ICLR 2025, "Gated Delta Networks") decays the whole memory by α_t ∈ (0, 1] first. In the layout of
this package, S ``[D, Dv]`` (keys × values) and rows for vectors:

    S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t

(the papers' S_t = S_{t-1}(I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t, transposed), with q and k L2-normalised by
the kernel, so that I - β_t k_t k_tᵀ is a contraction for β_t ∈ (0, 1]. Without a gate α_t = 1.

Shapes (query heads grouped by KV head, as everywhere in the kernels): ``q`` ``[B, H, G, M, D]`` (one query per key
position), ``k`` ``[B, H, M, D]``, ``v`` ``[B, H, M, Dv]``, ``beta`` ``[B, H, M]``, ``log_alpha`` ``[B, H, M]``
(ln α_t ≤ 0) or None, ``state`` ``[B, H, D, Dv]`` (the memory before the first key) or None (zero).
"""

from __future__ import annotations

import torch


def delta_rule_naive(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     log_alpha: torch.Tensor | None = None, state: torch.Tensor | None = None,
                     return_states: bool = False):
    """One token at a time: the outputs ``[B, H, G, M, Dv]`` (None when ``q`` is None), the memory after the last
    key, and with ``return_states`` the memory after every key ``[B, H, M, D, Dv]``. Differentiable; O(M·D·Dv) work
    in M sequential steps (the reference form, not a fast one)."""
    b, h, m, d = k.shape
    s = k.new_zeros(b, h, d, v.shape[-1]) if state is None else state
    outs, states = [], []
    for t in range(m):
        if log_alpha is not None:
            s = s * log_alpha[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        read = (kt.unsqueeze(-2) @ s).squeeze(-2)  # what the memory returns for k_t: Sᵀ k_t
        s = s + kt.unsqueeze(-1) * (beta[:, :, t, None] * (v[:, :, t] - read)).unsqueeze(-2)
        if q is not None:
            outs.append(q[:, :, :, t] @ s)  # [B, H, G, Dv]
        if return_states:
            states.append(s)
    out = None
    if q is not None:
        out = torch.stack(outs, 3) if outs else q.new_zeros(*q.shape[:-1], v.shape[-1])
    if return_states:
        return out, s, (torch.stack(states, 2) if states else k.new_zeros(b, h, 0, d, v.shape[-1]))
    return out, s
