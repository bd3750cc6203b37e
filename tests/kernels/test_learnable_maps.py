"""Learnable maps that attention transfer trains: the q/k projection of gaussian and cosine, and a
learnable ω for performer — forward and gradients against the float64 brute force (tests/kernels/reference.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels import reference as ref
from tests.kernels.helpers import SCALING, make_inputs, make_kernel, make_mask


def _perturb(kern, seed=7):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in kern.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return kern


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("mode", ["diagonal", "full"])
@pytest.mark.parametrize("name", ["gaussian", "cosine"])
def test_projection_matches_reference(name, mode, causal, padded):
    kern = _perturb(make_kernel(name, 4, 2, {"projection": mode}, randomize=False))
    q, k, v = make_inputs(2, 4, 2, 7, 7, seed=1)
    mask = make_mask(2, 7, causal) if padded else None
    out = kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    expected = ref.reference(kern, q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    rows = ref.real_queries(2, 7, 7, causal, mask)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["diagonal", "full"])
@pytest.mark.parametrize("name", ["gaussian", "cosine"])
def test_projection_identity_init_is_plain_kernel(name, mode):
    plain = make_kernel(name, 4, 2, randomize=False)
    projected = make_kernel(name, 4, 2, {"projection": mode}, randomize=False)
    q, k, v = make_inputs(1, 4, 2, 6, 6, seed=2)
    torch.testing.assert_close(projected(q, k, v, scaling=SCALING), plain(q, k, v, scaling=SCALING))




@pytest.mark.parametrize("name", ["gaussian", "cosine"])
def test_projection_gradients(name):
    """Finite differences of the float64 reference vs the kernel's autograd gradient for A and B."""
    kern = _perturb(make_kernel(name, 4, 2, {"projection": "full"}, randomize=False))
    q, k, v = make_inputs(2, 4, 2, 9, 9, seed=4)
    weight = torch.randn(2, 9, 4, v.shape[-1], generator=torch.Generator().manual_seed(5))
    (kern(q, k, v, causal=True, scaling=SCALING) * weight).sum().backward()
    gen = torch.Generator().manual_seed(9)
    k64 = copy.deepcopy(kern).double()  # perturb in float64: no rounding of the step
    for p, p64 in ((kern.projection.q, k64.projection.q), (kern.projection.k, k64.projection.k)):
        direction = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        h = 1e-6
        with torch.no_grad():
            base = p64.detach().clone()
            p64.copy_(base + h * direction)
            plus = (ref.reference(k64, q, k, v, causal=True, scaling=SCALING) * weight.double()).sum()
            p64.copy_(base - h * direction)
            minus = (ref.reference(k64, q, k, v, causal=True, scaling=SCALING) * weight.double()).sum()
            p64.copy_(base)
        numeric = float((plus - minus) / (2 * h))
        analytic = float((p.grad.double() * direction).sum())
        assert analytic == pytest.approx(numeric, rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_learnable_performer_forward_and_omega_gradient(causal):
    kern = make_kernel("performer", 4, 2, {"learnable": True, "num_features": 16}, randomize=False)
    assert isinstance(kern.omega, torch.nn.Parameter) and kern.omega.requires_grad
    fixed = make_kernel("performer", 4, 2, {"num_features": 16}, randomize=False)
    torch.testing.assert_close(kern.omega.detach(), fixed.omega)  # same draw as the fixed buffer
    q, k, v = make_inputs(2, 4, 2, 9, 9, seed=4)
    weight = torch.randn(2, 9, 4, v.shape[-1], generator=torch.Generator().manual_seed(5))
    out = kern(q, k, v, causal=causal, scaling=SCALING)
    expected = ref.reference(kern, q, k, v, causal=causal, scaling=SCALING)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-4, rtol=1e-4)
    (out * weight).sum().backward()
    omega64 = kern.omega.detach().double().requires_grad_(True)
    qd, kd, vd = q.double(), ref.repeat_kv(k.double(), 4), ref.repeat_kv(v.double(), 4)
    fq = ref.performer_features(omega64, qd, SCALING, kern.options.feature_eps, True)
    fk = ref.performer_features(omega64, kd, SCALING, kern.options.feature_eps, False)
    scores = torch.einsum("bhnf,bhmf->bhnm", fq, fk)
    vis = ref.visible(2, 9, 9, causal, None)
    brute = ref.normalised_kernel(scores, vd, vis, eps=kern.options.eps)
    (brute * weight.double()).sum().backward()
    torch.testing.assert_close(kern.omega.grad.double(), omega64.grad, atol=1e-4, rtol=1e-3)


def test_learnable_performer_rejects_redraw():
    with pytest.raises(ValueError, match="redraw"):
        make_kernel("performer", 4, 2, {"learnable": True, "redraw_interval": 10})


@pytest.mark.parametrize("name", ["gaussian", "cosine"])
def test_bad_projection(name):
    with pytest.raises(ValueError, match="projection must be one of"):
        make_kernel(name, 4, 2, {"projection": "diag"})
