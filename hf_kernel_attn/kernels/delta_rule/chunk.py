"""The delta rule over chunks: the WY / UT-transform form (Yang, Wang, Zhang, Shen, Kim, NeurIPS 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length"; with the gate of Yang, Kautz,
Hatamizadeh, ICLR 2025, "Gated Delta Networks"), the same numbers as the token recurrence of :mod:`.naive`.

Write the recurrence as S_t = α_t S_{t-1} + k_t u_tᵀ with u_t = β_t (v_t - α_t S_{t-1}ᵀ k_t), the value the token
actually writes. Within a chunk of C tokens starting from the memory S₀, with b_t = Σ_{s ≤ t in the chunk} ln α_s
and Γ_t = e^{b_t},

    u_t = β_t (v_t - Γ_t S₀ᵀ k_t - Σ_{j<t} e^{b_t - b_j} (k_t·k_j) u_j)

so all C writes solve one unit lower-triangular system (I + A) U = diag(β) V - diag(βΓ) K S₀ with
A_tj = β_t e^{b_t - b_j} k_t·k_j (j < t). With T = (I + A)⁻¹ (the UT transform, a triangular solve here):

    U = T diag(β) V - (T diag(βΓ) K) S₀ = U' - W S₀
    o_t = Γ_t S₀ᵀ q_t + Σ_{j ≤ t} e^{b_t - b_j} (q_t·k_j) u_j
    S_C = Γ_C S₀ + Σ_j e^{b_C - b_j} k_j u_jᵀ

U', W and the in-chunk scores depend on the chunk alone (one batched solve and matmul for every chunk at once);
only U = U' - W S₀, the outputs and the next memory run chunk after chunk. Every e^{b_t - b_j} has t ≥ j, so it
is at most 1 whatever the gates (no range limit on the chunk size). Autograd differentiates the form as written.
Shapes as in :mod:`.naive`.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 64


def _pad(x: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def delta_rule_chunk(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     log_alpha: torch.Tensor | None = None, state: torch.Tensor | None = None,
                     chunk_size: int = DEFAULT_CHUNK):
    """The outputs ``[B, H, G, M, Dv]`` (None when ``q`` is None: keys folded into the memory only) and the memory
    after the last key ``[B, H, D, Dv]``. Positions past M pad the last chunk with β = 0 and α = 1 (no write, no
    decay), which changes nothing before them."""
    b, h, m, d = k.shape
    dv = v.shape[-1]
    s = k.new_zeros(b, h, d, dv) if state is None else state
    if m == 0:
        return (None if q is None else q.new_zeros(*q.shape[:-1], dv)), s
    c = min(chunk_size, m)
    nc = -(-m // c)
    pad = nc * c - m
    kc = _pad(k, pad, 2).view(b, h, nc, c, d)
    vc = _pad(v, pad, 2).view(b, h, nc, c, dv)
    bc = _pad(beta, pad, 2).view(b, h, nc, c, 1)
    lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    kk = kc @ kc.transpose(-1, -2)  # [B, H, nc, C, C]
    if log_alpha is not None:
        g = _pad(log_alpha, pad, 2).view(b, h, nc, c).cumsum(-1)  # b_t within each chunk
        decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # e^{b_t - b_j}, t ≥ j
        gamma = g.exp().unsqueeze(-1)  # [B, H, nc, C, 1]
        to_end = (g[..., -1:] - g).exp().unsqueeze(-1)  # e^{b_C - b_j}
        carry = g[..., -1].exp()[..., None, None]  # [B, H, nc, 1, 1]
        a = (kk * decay).tril(-1) * bc
        rhs = torch.cat([vc * bc, kc * (bc * gamma)], -1)
    else:
        a = kk.tril(-1) * bc
        rhs = torch.cat([vc * bc, kc * bc], -1)
    x = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # the diagonal of a is not read
    u0, w = x[..., :dv], x[..., dv:]
    keys_to_end = kc if log_alpha is None else kc * to_end
    keys_t = keys_to_end.transpose(-1, -2)  # [B, H, nc, D, C]
    if q is not None:
        gq = q.shape[2]
        qc = _pad(q, pad, 3).view(b, h, gq, nc, c, d)
        scores = qc @ kc.unsqueeze(2).transpose(-1, -2)  # [B, H, G, nc, C, C]
        if log_alpha is not None:
            scores = scores * decay.unsqueeze(2)
            qc = qc * gamma.unsqueeze(2)
        scores = scores.tril()
        out = []
    # every chunk's views in one call (unbind: under autograd one gradient buffer for all of them, where indexing
    # chunk by chunk would allocate a whole-size zero gradient per chunk)
    u0s, ws, kts = u0.unbind(2), w.unbind(2), keys_t.unbind(2)
    carries = None if log_alpha is None else carry.unbind(2)
    if q is not None:
        qs, ss = qc.unbind(3), scores.unbind(3)
    for i in range(nc):
        u = u0s[i] - ws[i] @ s  # [B, H, C, Dv]
        if q is not None:
            out.append(qs[i] @ s.unsqueeze(2) + ss[i] @ u.unsqueeze(2))
        step = kts[i] @ u
        s = step + (s if carries is None else s * carries[i])
    if q is None:
        return None, s
    o = torch.stack(out, 3).view(b, h, q.shape[2], nc * c, dv)
    return (o[..., :m, :] if pad else o), s
