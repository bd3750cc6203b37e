"""The delta rule's decoding step: a few new tokens folded into a constant-size memory S ``[B, H, D, Dv]``
(:mod:`.naive` for the formula), O(D·Dv) per token and KV head whatever the context before it."""

from __future__ import annotations

import torch


def delta_rule_recurrent(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         log_alpha: torch.Tensor | None, state: torch.Tensor | None):
    """The outputs ``[B, H, G, L, Dv]`` of L new tokens (``q`` ``[B, H, G, L, D]``, or None) and the memory after them.
    The caller's ``state`` is never written to (a cache keeps it until the step succeeds)."""
    b, h, length, d = k.shape
    dv = v.shape[-1]
    s = k.new_zeros(b, h, d, dv) if state is None else state
    out = None if q is None else q.new_empty(*q.shape[:-1], dv)
    for t in range(length):
        if log_alpha is not None:
            s = s * log_alpha[:, :, t].exp()[..., None, None]
        kt = k[:, :, t].unsqueeze(-2)  # [B, H, 1, D]
        u = (v[:, :, t].unsqueeze(-2) - kt @ s) * beta[:, :, t, None, None]  # [B, H, 1, Dv]
        s = torch.baddbmm(s.flatten(0, 1), kt.transpose(-1, -2).flatten(0, 1), u.flatten(0, 1)).view(b, h, d, dv)
        if q is not None:
            out[:, :, :, t] = q[:, :, :, t] @ s
    return out, s
