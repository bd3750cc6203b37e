"""Whole-model training losses shared by the stages (and usable from users' own training loops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-level logit distillation (Hinton et al. 2015; the second stage of Mamba-in-the-Llama, Wang et
    al. 2024, and RADLADS, Goldstein et al. 2025):

        L = τ² · mean_t KL(p_T,t ‖ p_S,t),   p_·,t = softmax(logits_t / τ)

    over every position t (``mask`` ``[B, N]``: only positions where it is True/1). The τ² keeps gradient
    magnitudes comparable across temperatures. Logits ``[B, N, V]``; computed in fp32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    vocab = student_logits.shape[-1]
    log_s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float().reshape(-1, vocab) / temperature, dim=-1)
    per_token = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    if mask is None:
        kl = per_token.mean()
    else:
        weight = mask.reshape(-1).to(per_token.dtype)
        kl = (per_token * weight).sum() / weight.sum().clamp_min(1)
    return kl * temperature**2
