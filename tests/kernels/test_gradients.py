"""Gradients of the softmax-like kernels and skyformer (q, k, v and every learnable parameter) against autograd
through the independent float64 references of tests/kernels/reference.py; performer's ω redraw in training."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import reference as ref
from tests.kernels.helpers import SCALING, make_inputs, make_kernel, make_mask

f64 = torch.float64

SOFTMAX_LIKE = {
    "softmax": ("softmax", {}),
    "gaussian": ("gaussian", {}),
    "gaussian-sigma-unnormalized": ("gaussian", {"sigma": 1.7, "normalize": False}),
    "gaussian-augment": ("gaussian", {"augment": True}),
    "gaussian-proj-full": ("gaussian", {"projection": "full"}),
    "gaussian-proj-diagonal": ("gaussian", {"projection": "diagonal"}),
    "cosine": ("cosine", {}),
    "cosine-proj-full": ("cosine", {"projection": "full"}),
}


def perturb_projection(kern: torch.nn.Module) -> None:
    """Move a q/k projection off its identity init, so its gradient has no special structure."""
    proj = getattr(kern, "projection", None)
    if proj is None:
        return
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (proj.q, proj.k):
            p.add_(0.2 * torch.randn(p.shape, generator=gen))


def gradients(kern, q, k, v, mask, causal: bool, fn) -> dict[str, torch.Tensor]:
    """d/d(q, k, v, parameters) of Σ w · out over the rows that are real and see a key."""
    n, m = q.shape[-2], k.shape[-2]
    rows = ref.real_queries(q.shape[0], n, m, causal, mask)
    w = torch.randn(q.shape[0], n, q.shape[1], v.shape[-1], generator=torch.Generator().manual_seed(4), dtype=f64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kern.zero_grad(set_to_none=True)
    out = fn(kern, *leaves, key_mask=mask, causal=causal, scaling=SCALING)
    (out.double()[rows] * w[rows]).sum().backward()
    grads = {"q": leaves[0].grad, "k": leaves[1].grad, "v": leaves[2].grad}
    grads.update({name: p.grad.clone() for name, p in kern.named_parameters() if p.grad is not None})
    return grads


def call_kernel(kern, q, k, v, **kw):
    return kern(q, k, v, **kw)


def compare(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """fp32 kernels against the fp64 reference: 1e-3 of each gradient's scale."""
    assert got.keys() == expected.keys()
    for key in got:
        scale = expected[key].abs().max().item()
        assert scale > 0, f"d{key} is zero: nothing compared"
        torch.testing.assert_close(got[key].double(), expected[key].double(), atol=1e-3 * scale, rtol=1e-3,
                                   msg=lambda m, key=key: f"d{key}: {m}")


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("nm", [(9, 9), (5, 11)], ids=["N=M", "N<M"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", list(SOFTMAX_LIKE))
def test_softmax_like_gradients_match_reference(variant, causal, nm, padded):
    name, params = SOFTMAX_LIKE[variant]
    kern = make_kernel(name, 4, 2, params, randomize=not params.get("augment", False))
    perturb_projection(kern)
    n, m = nm
    q, k, v = make_inputs(2, 4, 2, n, m, seed=31)
    mask = make_mask(2, m, causal) if padded else None
    got = gradients(kern, q, k, v, mask, causal, call_kernel)
    expected = gradients(kern, q, k, v, mask, causal, ref.reference)
    learnable = {n for n, p in kern.named_parameters() if p.requires_grad}
    assert learnable <= got.keys()  # every learnable parameter got a gradient, and it is compared
    if name != "softmax":
        assert "log_gain" in learnable
    if "projection" in params:
        assert {"projection.q", "projection.k"} <= learnable
    compare(got, expected)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("params", [{"num_landmarks": 8}, {"num_landmarks": 6, "normalize": False}],
                         ids=["8", "6-unnormalized"])
def test_skyformer_gradients_match_reference(params, padded):
    """Newton–Schulz (30 steps, converged) vs the reference's exact inverse, gradients included."""
    kern = make_kernel("skyformer", 4, 2, {"newton_iters": 30, **params})
    q, k, v = make_inputs(2, 4, 2, 14, 14, seed=32)
    mask = make_mask(2, 14, False, pad=4) if padded else None
    got = gradients(kern, q, k, v, mask, False, call_kernel)
    expected = gradients(kern, q, k, v, mask, False, ref.reference)
    compare(got, expected)


# ------------------------------------------------------------------------------------ performer redraw


def test_performer_redraw_every_interval_in_training_only():
    """redraw_interval=2: ω changes before calls 2, 4, ... in training mode, never in eval; the draws are
    deterministic and the output always uses the current ω (checked against the reference)."""
    q, k, v = make_inputs(1, 4, 2, 6, 6, seed=33)
    kern = make_kernel("performer", 4, 2, {"redraw_interval": 2, "num_features": 16})
    twin = make_kernel("performer", 4, 2, {"redraw_interval": 2, "num_features": 16})
    kern.train()
    twin.train()
    seen = []
    for call in range(5):
        before = kern.omega.clone()
        out = kern(q, k, v, causal=True, scaling=SCALING)
        twin(q, k, v, causal=True, scaling=SCALING)
        changed = not torch.equal(before, kern.omega)
        assert changed == (call in (2, 4)), f"call {call}: redrawn={changed}"
        assert torch.equal(kern.omega, twin.omega)  # same seed: same sequence of draws
        torch.testing.assert_close(out.double(), ref.reference(kern, q, k, v, causal=True, scaling=SCALING),
                                   atol=1e-4, rtol=1e-4)
        seen.append(kern.omega.clone())
    assert not torch.equal(seen[2], seen[4]) and not torch.equal(seen[0], seen[2])
    # a redrawn ω is still a FAVOR+ draw: rows within a D-block orthogonal, norms spread (chi, not constant)
    block = seen[4][:8].double()
    gram = block @ block.T
    assert (gram - torch.diag(gram.diagonal())).abs().max() < 1e-4 * gram.diagonal().max()
    assert gram.diagonal().std() > 0.1
    kern.eval()
    frozen = kern.omega.clone()
    for _ in range(4):
        kern(q, k, v, causal=True, scaling=SCALING)
    assert torch.equal(frozen, kern.omega)
