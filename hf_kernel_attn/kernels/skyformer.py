"""Skyformer: Gaussian-kernel attention with a Nyström approximation, bidirectional only
(Chen et al., NeurIPS 2021, "Skyformer: Remodel Self-Attention with Gaussian Kernel and Nyström Method").

With q' = s^1/2 q, k' = s^1/2 k and X = [Q'; K'], κ(x, y) = exp(-||x - y||²/2) is PSD on X. Pick
landmarks L ⊂ X (half among the real queries, half among the real keys, evenly spaced so that the
result does not depend on padding), then

    C = κ(Q', K') ≈ κ(Q', L) · W · κ(L, K'),   W = D^-1/2 (M')⁻¹ D^-1/2,
    M' = D^-1/2 (κ(L, L) + ridge·I) D^-1/2,    D = rowsum(κ(L, L) + ridge·I),

with (M')⁻¹ from ``newton_iters`` Newton–Schulz steps. The output is evaluated right to left in
O(N · landmarks). ``normalize=True`` (default) divides by the approximated row sums C·1, which makes
it a drop-in for a pretrained softmax encoder (the Gaussian row-normalised is softmax with a key-norm
bias, see gaussian.py); ``normalize=False`` returns the paper's unnormalised C V.

``form`` picks the evaluation per call: ``nystrom`` always approximates; ``exact`` always computes the
exact Gaussian exp(-s||q - k||²/2) (row-normalised through fused SDPA, as ``gaussian`` does); ``auto``
(default) runs the exact form when N ≤ num_landmarks (Nyström with every point a landmark is the exact
kernel up to the ridge) or when its matmul work is below Nyström's (:func:`exact_is_cheaper`): at
encoder lengths (up to ~500 tokens with 64 landmarks, D = 32) landmarks and Newton–Schulz cost more than
the N×N kernel they approximate.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .base import EPS_RANGE, MAX_TOKENS, Kernel, KernelOptions, integer_in, number_in, one_of, option
from .gaussian import normalized_gaussian, unnormalized_gaussian

FORMS = ("auto", "nystrom", "exact")
# fused SDPA runs at several times the GFLOP/s of Nyström's small per-sequence matmuls, cdist and
# Newton–Schulz steps (2 CPU cores, MiniLM shapes): a FLOP of Nyström work counts double
NYSTROM_COST_FACTOR = 2.0


@dataclasses.dataclass
class SkyformerOptions(KernelOptions):
    num_landmarks: int = option(64, "Nyström landmarks, half among the real queries and half among the real keys",
                                bound="tokens")
    ridge: float = option(0.1, "ridge added to the landmarks' Gram matrix κ(L, L) before inverting it")
    newton_iters: int = option(6, "Newton–Schulz steps of the landmark pseudo-inverse")
    normalize: bool = option(True, "divide by the approximated row sums (a softmax drop-in); False = the "
                                   "paper's unnormalised C V")
    eps: float = option(1e-6, "floor of the approximated row sums")
    form: str = option("auto", "auto | nystrom | exact: auto computes the exact Gaussian where that is cheaper "
                               "than Nyström (short sequences)")

    def validate(self) -> None:
        integer_in("num_landmarks", self.num_landmarks, 2, MAX_TOKENS)
        integer_in("newton_iters", self.newton_iters, 1, 100)
        number_in("ridge", self.ridge, 0.0, 1e4, low_open=True)
        number_in("eps", self.eps, *EPS_RANGE, meaning="a floor far below the row sums")
        one_of("normalize", self.normalize, (True, False))
        one_of("form", self.form, FORMS)


def gaussian_gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """exp(-||x_i - y_j||² / 2) for ``[..., N, D]`` x ``[..., M, D]``."""
    return torch.exp(-torch.cdist(x, y).pow(2) / 2)


def evenly_spaced(real: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` indices spread evenly over the positions where ``real`` is True."""
    idx = real.nonzero().squeeze(-1)
    if idx.numel() == 0:
        idx = torch.arange(real.numel(), device=real.device)
    pick = torch.linspace(0, idx.numel() - 1, min(count, idx.numel()), device=real.device).round().long()
    return idx[pick]


def newton_schulz_inverse(m: torch.Tensor, iters: int) -> torch.Tensor:
    """Z ← ¼ Z (13I − MZ(15I − MZ(7I − MZ))), started at Mᵀ / max column sum (Nyströmformer)."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    z = m.transpose(-1, -2) / m.abs().sum(-2).amax(-1)[..., None, None]
    for _ in range(iters):
        mz = m @ z
        z = 0.25 * z @ (13 * eye - mz @ (15 * eye - mz @ (7 * eye - mz)))
    return z


def exact_is_cheaper(n: int, d: int, dv: int, landmarks: int, newton_iters: int) -> bool:
    """Per head and sequence: exact ≈ N²(D + Dv + 1) multiply-adds; Nyström ≈ L(2N)(D + Dv) for
    κ(Q,L), κ(L,K) and the products, + L²(D + Dv) + 3·iters·L³ for the inverse, weighted by
    NYSTROM_COST_FACTOR."""
    if n <= landmarks:
        return True
    nystrom = landmarks * 2 * n * (d + dv) + landmarks**2 * (d + dv) + 3 * newton_iters * landmarks**3
    return n * n * (d + dv + 1) <= NYSTROM_COST_FACTOR * nystrom


class SkyformerKernel(Kernel):
    name = "skyformer"
    kind = "nystrom"
    # the kit checks the exact Gaussian the Nyström form approximates; the approximation itself is checked
    # against an explicit Nyström reference with an exact inverse in the test suite
    conformance_params = {"form": "exact"}
    options_cls = SkyformerOptions
    supports_causal = False
    paper = "Chen et al., NeurIPS 2021, Skyformer"

    def uses_exact(self, n: int, d: int, dv: int) -> bool:
        """Whether a call over N tokens runs the exact Gaussian (see ``form``)."""
        if self.options.form != "auto":
            return self.options.form == "exact"
        return exact_is_cheaper(n, d, dv, self.options.num_landmarks, self.options.newton_iters)

    def landmark_factors(self, q: torch.Tensor, k: torch.Tensor, real: torch.Tensor):
        """For one sequence: q, k ``[H, N, D]`` scaled; returns κ(Q, L) ``[H, N, L]``, W, κ(L, K)."""
        half = self.options.num_landmarks // 2
        iq = evenly_spaced(real, half)
        ik = evenly_spaced(real, half)
        lm = torch.cat([q[:, iq], k[:, ik]], 1)  # [H, L, D]
        gram = gaussian_gram(lm, lm) + self.options.ridge * torch.eye(lm.shape[1], device=q.device)
        d_inv_sqrt = gram.sum(-1).rsqrt()  # [H, L]
        m_norm = d_inv_sqrt[..., :, None] * gram * d_inv_sqrt[..., None, :]
        inv = newton_schulz_inverse(m_norm, self.options.newton_iters)
        w = d_inv_sqrt[..., :, None] * inv * d_inv_sqrt[..., None, :]
        return gaussian_gram(q, lm), w, gaussian_gram(lm, k)

    def log_scores(self, q, k, scaling):
        """log κ = -s |q - k|² / 2 (unit bandwidth on s^1/2-scaled q, k), the kernel Nyström approximates."""
        return -scaling * torch.cdist(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1)).pow(2) / 2

    def forward(self, q, k, v, *, key_mask=None, causal=False, scaling=None, dropout=0.0):
        self.check_inputs(q, k, v, causal)
        if q.shape[-2] != k.shape[-2]:
            raise ValueError("skyformer needs self-attention (as many queries as keys)")
        s = q.shape[-1] ** -0.5 if scaling is None else scaling
        if self.uses_exact(q.shape[-2], q.shape[-1], v.shape[-1]):
            exact = normalized_gaussian if self.options.normalize else unnormalized_gaussian
            return exact(q, k, v, s, key_mask=key_mask, causal=False).to(q.dtype)
        scale = math.sqrt(s)
        g = q.shape[1] // k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qf = q.float() * scale
            kf = (k.float() * scale).repeat_interleave(g, 1) if g > 1 else k.float() * scale
            vf = v.float().repeat_interleave(g, 1) if g > 1 else v.float()
            outs = []
            for b in range(q.shape[0]):
                real = key_mask[b].bool() if key_mask is not None else torch.ones(k.shape[-2], dtype=torch.bool,
                                                                                  device=q.device)
                left, w, right = self.landmark_factors(qf[b], kf[b], real)
                right = right * real[None, None, :]
                num = left @ (w @ (right @ vf[b]))
                if self.options.normalize:
                    den = left @ (w @ right.sum(-1, keepdim=True))
                    num = num / den.clamp_min(self.options.eps)
                outs.append(num)
            out = torch.stack(outs)
        return out.transpose(1, 2).contiguous().to(q.dtype)
