"""Performer (FAVOR+): positive orthogonal random features, E[φ(q)·φ(k)] ∝ exp(s q·k) (Choromanski et al.,
ICLR 2021), with a hand-written feature backward (:class:`PositiveRandomFeatures`)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..base import MAX_FEATURES, LayerShape, accum, integer_in, number_in, option
from .base import MAX_SEED, LinearKernel, LinearOptions, layer_generator


@dataclasses.dataclass
class PerformerOptions(LinearOptions):
    num_features: int | None = option(None, "m random features; None = ⌊D ln D⌋", bound="features")
    feature_eps: float = option(1e-4, "ε added to every feature (keeps the normaliser away from 0)")
    seed: int = option(0, "seed of the random directions ω (drawn with the layer index)")
    redraw_interval: int | None = option(None, "in training, redraw ω every this many calls; None = never")
    learnable: bool = option(False, "ω becomes a parameter (trained by attention transfer)")

    def validate(self) -> None:
        super().validate()
        if self.learnable and self.redraw_interval:
            raise ValueError("performer: learnable=True trains ω, so it cannot also be redrawn (redraw_interval)")
        if self.num_features is not None:
            integer_in("num_features", self.num_features, 1, MAX_FEATURES, meaning="or None for ⌊D ln D⌋")
        if self.redraw_interval is not None:
            integer_in("redraw_interval", self.redraw_interval, 1, 2**31, meaning="calls, or None = never")
        number_in("feature_eps", self.feature_eps, 0.0, 1.0, low_open=True)
        integer_in("seed", self.seed, 0, MAX_SEED)


def orthogonal_gaussian(m: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """m×d rows: blocks of orthonormal directions (QR of Gaussian blocks) with chi(d)-distributed
    norms, the positive orthogonal random features of FAVOR+ (Choromanski et al., ICLR 2021)."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        qmat, r = torch.linalg.qr(g)
        qmat = qmat * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)  # sign fix: Haar, isotropic rows
        blocks.append(qmat.T)
    w = torch.cat(blocks)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1)
    return (w * norms[:, None]).float()


class PerformerKernel(LinearKernel):
    """FAVOR+: φ(x) = m^-1/2 (exp(ωᵀx' - ||x'||²/2 - c) + ε) with x' = s^1/2 x, so that
    E[φ(q)·φ(k)] ∝ exp(s q·k) (Choromanski et al., ICLR 2021, Rethinking Attention with Performers).

    c is the per-row max for queries (cancels exactly) and 0 for keys: any data-dependent key
    constant would differ between prefill and decoding (and leak later keys into earlier rows through
    ε), while a loose bound such as max_l ||ω_l||²/2 pushes every key feature below ε. Unshifted, a
    key exponent is at most max_l ||ω_l||²/2 (≈ 60 at D = 64); it is clamped at 60 so that sums over
    64k keys stay finite in fp32.
    ω is a fixed per-layer buffer drawn from ``seed`` and the layer index (saved with the model); with
    ``learnable=True`` it starts from the same draw and is a parameter that attention transfer trains.
    """

    name = "performer"
    options_cls = PerformerOptions
    paper = "Choromanski et al., ICLR 2021, Rethinking Attention with Performers"

    def __init__(self, shape: LayerShape, options: PerformerOptions):
        super().__init__(shape, options)
        d = shape.head_dim
        m = options.num_features or max(1, int(d * math.log(d)))  # ⌊D ln D⌋, at least 1 (D = 1 gives 0)
        if options.learnable:
            self.omega = nn.Parameter(torch.empty(m, d))
        else:
            self.register_buffer("omega", torch.empty(m, d))
        self.calls = 0

    def reset_parameters(self) -> None:
        super().reset_parameters()
        gen = layer_generator(self.options.seed, self.shape.layer_idx)
        with torch.no_grad():
            self.omega.copy_(orthogonal_gaussian(self.omega.shape[0], self.omega.shape[1], gen))

    def redraw(self) -> None:
        gen = layer_generator(self.options.seed + self.calls, self.shape.layer_idx)
        with torch.no_grad():
            self.omega.copy_(orthogonal_gaussian(self.omega.shape[0], self.omega.shape[1], gen))

    def num_features(self) -> int:
        return int(self.omega.shape[0])

    def projection_width(self, backward: bool = False) -> int:
        return int(self.omega.shape[0])

    def feature_q(self, q, pos, scaling):
        # the row max of ωᵀx' - ||x'||²/2 is max(ωᵀx') - ||x'||²/2, so the norm term cancels
        return self._features(q, scaling, is_query=True)

    def feature_k(self, k, pos, scaling):
        return self._features(k, scaling, is_query=False)

    def _features(self, x, scaling, is_query):
        omega = accum(self.omega) * math.sqrt(scaling)  # ω' = s^1/2 ω, so ω'ᵀx = ωᵀx'
        args = (omega, scaling, is_query, self.omega.shape[0], self.options.feature_eps)
        if omega.requires_grad:
            return _positive_random_features_autograd(x, *args)
        if x.requires_grad:
            return PositiveRandomFeatures.apply(x, *args)
        return positive_random_features(x, *args, for_backward=False)[0]

    def forward_with_state(self, q, k, v, **kw):
        interval = self.options.redraw_interval
        if self.training and interval:
            if self.calls % interval == 0 and self.calls > 0:
                self.redraw()
            self.calls += 1
        return super().forward_with_state(q, k, v, **kw)


def positive_random_features(x, omega, scaling, is_query, m, feature_eps, for_backward=True):
    """m^-1/2 (exp(a) + ε) with a = ω'ᵀx - shift: shift = max_l ω'_lᵀx for queries, s ||x||²/2 for keys
    (whose exponent is then capped at 60), computed in place as exp(a + ln c) + c ε, c = m^-1/2.
    Also returns what the backward needs (``for_backward``): the argmax (queries) or the uncapped mask
    (keys)."""
    log_c = -0.5 * math.log(m)
    p = x @ omega.T
    where = None
    if is_query:
        if for_backward:
            top, where = p.max(-1, keepdim=True)
        else:
            top = p.amax(-1, keepdim=True)
        p.sub_(top - log_c)
    else:
        p.sub_(x.pow(2).sum(-1, keepdim=True) * (scaling / 2) - log_c)
        if for_backward:
            where = p < 60.0 + log_c
        p.clamp_max_(60.0 + log_c)
    return p.exp_().add_(feature_eps * math.exp(log_c)), where


def _positive_random_features_autograd(x, omega, scaling, is_query, m, feature_eps):
    """The same features out of plain differentiable ops, for a trained ω (gradient w.r.t. ω too)."""
    log_c = -0.5 * math.log(m)
    p = x @ omega.T
    if is_query:
        p = p - p.amax(-1, keepdim=True)
    else:
        p = (p - x.pow(2).sum(-1, keepdim=True) * (scaling / 2)).clamp_max(60.0)
    return (p + log_c).exp() + feature_eps * math.exp(log_c)


class PositiveRandomFeatures(torch.autograd.Function):
    """FAVOR+ features with a hand-written backward that keeps only x, φ and the argmax/cap mask. With
    e = φ - cε = exp(a) and g_a = g ⊙ e: keys dx = g_a ω' - (Σ_l g_a) s x (zero where capped);
    queries dx = g_a ω' - (Σ_l g_a) ω'_argmax (the max's gradient goes to its argmax)."""

    @staticmethod
    def forward(ctx, x, omega, scaling, is_query, m, feature_eps):
        phi, where = positive_random_features(x, omega, scaling, is_query, m, feature_eps)
        ctx.save_for_backward(x, omega, phi, where)
        ctx.scaling, ctx.is_query, ctx.eps_c = scaling, is_query, feature_eps * m**-0.5
        return phi

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad):
        x, omega, phi, where = ctx.saved_tensors
        g_a = grad * (phi - ctx.eps_c)
        if not ctx.is_query:
            g_a = g_a * where
        total = g_a.sum(-1, keepdim=True)
        dx = g_a @ omega
        if ctx.is_query:
            dx -= total * omega[where.squeeze(-1)]
        else:
            dx -= total * ctx.scaling * x
        return dx, None, None, None, None, None
