"""Taylor (Based): φ(x) = [1, s^1/2 x, s/√2 · u(x)], so φ(q)·φ(k) = 1 + t + t²/2 with t = s q·k (Arora et al.,
ICML 2024), with a closed form for the quadratic paths and a hand-written feature backward (:class:`TaylorFeatures`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .. import linear
from ..base import MAX_TOKENS, accum, integer_in, option
from .base import LinearKernel, LinearOptions


def _taylor_series(t: torch.Tensor) -> torch.Tensor:
    """1 + t + t²/2, in place."""
    return t.mul(0.5).add_(1.0).mul_(t).add_(1.0)


@functools.cache
def _upper_triangle(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index pairs i ≤ j and weights 1/√2 (diagonal) or 1 (off-diagonal pairs appear once, so they carry
    √2): Σ_{i≤j} (√2 w_ij)² x_i x_j y_i y_j = (x·y)²."""
    i, j = torch.triu_indices(d, d, device=device)
    ones = torch.ones(i.shape, dtype=torch.float64, device=device)
    weight = torch.where(i == j, ones / math.sqrt(2.0), ones)  # float64, cast to the input's dtype on use
    return i, j, weight


@dataclasses.dataclass
class TaylorOptions(LinearOptions):
    quadratic_below: int | None = option(None, "without grad, the quadratic N×N form up to this N (both modes); "
                                               "None = whichever costs fewer multiply-adds")

    def validate(self) -> None:
        super().validate()
        if self.quadratic_below is not None:
            integer_in("quadratic_below", self.quadratic_below, 0, MAX_TOKENS, meaning="or None")


class TaylorKernel(LinearKernel):
    """Second-order Taylor map φ(x) = [1, s^1/2 x, s/√2 · u(x)] with u(x)·u(y) = (x·y)² (upper
    triangle of xxᵀ, off-diagonal terms × √2), so φ(q)·φ(k) = 1 + t + t²/2 with t = s q·k
    (Arora et al., ICML 2024, Based; Keles et al. 2023)."""

    name = "taylor"
    options_cls = TaylorOptions
    paper = "Arora et al., ICML 2024, Simple linear attention language models (Based)"

    def num_features(self) -> int:
        d = self.shape.head_dim
        return 1 + d + d * (d + 1) // 2

    def closed_form(self, q, k, scaling):
        """φ(q)·φ(k) = 1 + t + t²/2 with t = q'·k', q' = s^1/2 q: D-dim dot products instead of F-dim."""
        root = math.sqrt(scaling)
        return linear.ClosedForm(accum(q) * root, accum(k) * root, _taylor_series)

    def feature(self, x, pos, scaling):
        d = x.shape[-1]
        xs = x * math.sqrt(scaling)
        rows = xs.numel() // d
        if xs.requires_grad:
            return TaylorFeatures.apply(xs)
        if rows >= 256 or rows == 0:  # no rows (no keys to score yet): the empty feature tensor
            return _taylor_features(xs)
        # few rows (decoding): gather whole rows of xsᵀ, much faster than gathering columns or looping
        i, j, weight = _upper_triangle(d, x.device)
        xt = xs.reshape(rows, d).T.contiguous()
        second = (xt.index_select(0, i) * xt.index_select(0, j) * weight.to(xs.dtype)[:, None]).T
        return torch.cat([torch.ones_like(xs[..., :1]), xs, second.reshape(*xs.shape[:-1], -1)], -1)


def _taylor_features(xs: torch.Tensor) -> torch.Tensor:
    """[1, x, u(x)] with u(x) the upper triangle of x xᵀ (diagonal × 1/√2), written row by row into one
    buffer: ``u`` holds x_r · x[r:] for r = 0, 1, ..."""
    d = xs.shape[-1]
    out = xs.new_empty(*xs.shape[:-1], 1 + d + d * (d + 1) // 2)
    out[..., 0] = 1.0
    out[..., 1:d + 1] = xs
    offset = d + 1
    for r in range(d):
        out[..., offset:offset + d - r] = xs[..., r:r + 1] * xs[..., r:]
        out[..., offset].mul_(math.sqrt(0.5))
        offset += d - r
    return out


class TaylorFeatures(torch.autograd.Function):
    """:func:`_taylor_features` with a hand-written backward that saves only x (D values per row, not
    the F = 2,145 features or autograd's gathered copies): for u_rj = w_rj x_r x_j (j ≥ r),
    dx_r += Σ_j w_rj g_rj x_j and dx_j += w_rj g_rj x_r."""

    @staticmethod
    def forward(ctx, xs):
        ctx.save_for_backward(xs)
        return _taylor_features(xs)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad):
        (xs,) = ctx.saved_tensors
        d = xs.shape[-1]
        dx = grad[..., 1:d + 1].clone()
        offset = d + 1
        for r in range(d):
            g = grad[..., offset:offset + d - r].clone()
            g[..., 0] *= math.sqrt(0.5)
            dx[..., r] += (g * xs[..., r:]).sum(-1)
            dx[..., r:].addcmul_(g, xs[..., r:r + 1])
            offset += d - r
        return dx
