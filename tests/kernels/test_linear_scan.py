"""The chunked causal scan, its hand-written backward and the blocked no-grad path, against brute force.

The brute force here is the O(N²) double loop over positions written from the formula; gradients of the
full kernels are compared with autograd through tests/kernels/reference.py in float64.
"""

from __future__ import annotations

import pytest
import torch

from hf_kernel_attn.kernels import KERNELS, linear
from hf_kernel_attn.kernels.feature_maps import performer, taylor
from hf_kernel_attn.kernels.linear import cost
from tests.kernels import reference as ref
from tests.kernels.helpers import LINEAR, SCALING, make_inputs, make_kernel, make_mask

f64 = torch.float64


def brute_scan(q, k, v, s0, gq, gk):
    """o_(t,g) = Σ_{t'≤t, g'} (q·k) v + q S₀; S_N = S₀ + Σ k vᵀ, by loops (a decay is the gated engine's,
    tests/kernels/test_gated_scan.py)."""
    n = k.shape[1] // gk
    outs = []
    for t in range(n):
        for g in range(gq):
            qi = q[:, t * gq + g]  # [BH, a]
            acc = torch.einsum("ba,bac->bc", qi, s0)
            for tp in range(t + 1):
                for gp in range(gk):
                    kj, vj = k[:, tp * gk + gp], v[:, tp * gk + gp]
                    acc = acc + (qi * kj).sum(-1)[:, None] * vj
            outs.append(acc)
    final = s0
    for tp in range(n):
        for gp in range(gk):
            kj, vj = k[:, tp * gk + gp], v[:, tp * gk + gp]
            final = final + kj[:, :, None] * vj[:, None, :]
    return torch.stack(outs, 1), final


def scan_inputs(n, gq, gk, heads=2, batch=2, a=4, b=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bh = batch * heads
    q = torch.randn(bh, n * gq, a, generator=gen, dtype=f64)
    k = torch.randn(bh, n * gk, a, generator=gen, dtype=f64)
    v = torch.randn(bh, n * gk, b, generator=gen, dtype=f64)
    s0 = torch.randn(bh, a, b, generator=gen, dtype=f64)
    return q, k, v, s0


@pytest.mark.parametrize("groups", [(1, 1), (3, 1), (1, 2)], ids=["g1", "gq3", "gk2"])
@pytest.mark.parametrize("n,chunk", [(1, 4), (9, 4), (9, 64), (12, 4)], ids=["n1", "tail", "onechunk", "exact"])
def test_scan_matches_brute_force(n, chunk, groups):
    gq, gk = groups
    q, k, v, s0 = scan_inputs(n, gq, gk)
    state = s0.clone()
    out = linear.scan(q, k, v, state, linear.ScanLayout(gq, gk, chunk))
    exp_out, exp_state = brute_scan(q, k, v, s0, gq, gk)
    torch.testing.assert_close(out, exp_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state, exp_state, atol=1e-10, rtol=1e-10)


def flip_positions(x, group):
    bh, rows, c = x.shape
    return x.view(bh, rows // group, group, c).flip(1).reshape(bh, rows, c)


@pytest.mark.parametrize("groups", [(1, 1), (3, 1), (1, 3)], ids=["g1", "gq3", "gk3"])
@pytest.mark.parametrize("n,chunk", [(1, 4), (9, 4), (12, 4)], ids=["n1", "tail", "exact"])
def test_reverse_scan_is_the_flipped_scan(n, chunk, groups):
    """reverse=True equals flipping every input's positions, the brute-force scan, and flipping back."""
    gq, gk = groups
    q, k, v, s0 = scan_inputs(n, gq, gk, seed=7)
    state = s0.clone()
    out = linear.scan(q, k, v, state, linear.ScanLayout(gq, gk, chunk, reverse=True))
    exp_out, exp_state = brute_scan(flip_positions(q, gq), flip_positions(k, gk), flip_positions(v, gk), s0, gq, gk)
    torch.testing.assert_close(out, flip_positions(exp_out, gq), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state, exp_state, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("gq", [1, 3])
def test_causal_scan_backward_matches_brute_force(gq):
    """Gradients of q, k, v and the initial state, from a loss on both the outputs and the final state."""
    n, chunk = 11, 4
    inputs = scan_inputs(n, gq, 1, seed=1)
    gen = torch.Generator().manual_seed(2)
    w_out = torch.randn(4, n * gq, 3, generator=gen, dtype=f64)
    w_state = torch.randn(4, 4, 3, generator=gen, dtype=f64)
    grads = []
    for fn in ("scan", "brute"):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        if fn == "scan":
            out, state = linear.CausalScan.apply(*leaves, gq, chunk)
        else:
            out, state = brute_scan(*leaves, gq, 1)
        ((out * w_out).sum() + (state * w_state).sum()).backward()
        grads.append([t.grad for t in leaves])
    for name, got, exp in zip("q k v state".split(), *grads, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10, msg=f"d{name}")


def kernel_and_reference_grads(name, causal, n, m, padded, chunk):
    kern = make_kernel(name, 4, 2, {"chunk_size": chunk}, max_positions=400).double()
    q, k, v = make_inputs(2, 4, 2, n, m, dtype=f64, seed=3)
    mask = make_mask(2, m, causal, pad=10) if padded else None
    rows = ref.real_queries(2, n, m, causal, mask)
    w = torch.randn(2, n, 4, v.shape[-1], dtype=f64, generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in ("kernel", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        kern.zero_grad()
        if fn == "kernel":
            out = kern(*leaves, key_mask=mask, causal=causal, scaling=SCALING)
        else:
            out = ref.reference(kern, *leaves, key_mask=mask, causal=causal, scaling=SCALING)
        (out[rows] * w[rows]).sum().backward()
        params = {p_name: p.grad.clone() for p_name, p in kern.named_parameters() if p.grad is not None}
        grads.append({"q": leaves[0].grad, "k": leaves[1].grad, "v": leaves[2].grad, **params})
    return grads


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("nm", [(40, 40), (9, 40)], ids=["N=M", "N<M"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", LINEAR)
def test_kernel_gradients_match_reference(name, causal, nm, padded):
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")
    """Every linear kernel's gradients (q, k, v and its own parameters) equal autograd through the float64
    reference: chunk 7 so the scan crosses chunks and ends on a partial one; N < M puts a prefix state
    (which itself needs gradients) in front of the scan."""
    got, expected = kernel_and_reference_grads(name, causal, *nm, padded, chunk=7)
    assert got.keys() == expected.keys()
    if name == "hedgehog":
        assert {"weight_q", "bias_q", "weight_k", "bias_k"} <= got.keys()
    for key in got:
        torch.testing.assert_close(got[key], expected[key], atol=1e-9, rtol=1e-7, msg=f"d{key}")


@pytest.fixture
def tiny_blocks(monkeypatch):
    """One chunk per block, so the no-grad causal path crosses many blocks."""
    monkeypatch.setattr(cost, "BLOCK_FEATURE_VALUES", 1)


@pytest.mark.parametrize("name", LINEAR)
def test_blocked_path_across_blocks(name, tiny_blocks):
    kern = make_kernel(name, 4, 2, {"chunk_size": 7}, max_positions=400)
    assert kern.block_length(8) == 7
    q, k, v = make_inputs(2, 4, 2, 150, 150, seed=11)
    mask = make_mask(2, 150, True, pad=10)
    with torch.no_grad():
        out = kern(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    expected = ref.reference(kern, q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    rows = ref.real_queries(2, 150, 150, True, mask)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", LINEAR)
def test_no_grad_and_grad_paths_agree(name, causal, tiny_blocks):
    """The blocked no-grad forward and the differentiable forward give the same outputs and states
    (tiny blocks, so the no-grad path crosses many)."""
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")
    kern = make_kernel(name, 6, 2, {"chunk_size": 16}, max_positions=400)
    q, k, v = make_inputs(1, 6, 2, 100, 100, seed=5)
    mask = torch.ones(1, 100, dtype=torch.bool)
    mask[0, :5] = False  # padding (left for causal, and it need not be at the end for the bidirectional form)
    with torch.no_grad():
        out_a, state_a = kern.forward_with_state(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    q.requires_grad_(True)
    out_b, state_b = kern.forward_with_state(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    assert out_b.requires_grad
    torch.testing.assert_close(out_a, out_b.detach(), atol=1e-5, rtol=1e-5)
    if not causal:
        assert state_a is None and state_b is None
        return
    torch.testing.assert_close(state_a.S, state_b.S.detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state_a.z, state_b.z.detach(), atol=1e-4, rtol=1e-5)


def test_state_gradient_through_kernel():
    """A loss on the returned state back-propagates into the keys and values that built it."""
    kern = make_kernel("dijiang", 4, 2, {"chunk_size": 5}).double()
    q, k, v = make_inputs(1, 4, 2, 12, 12, dtype=f64, seed=6)
    k.requires_grad_(True)
    v.requires_grad_(True)
    _, state = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
    state.S.sum().backward()
    fk = kern.feature_k(k.detach(), torch.arange(12), SCALING)
    # the decay as the gated engine's constant gate: the state is decayed to the last key it holds,
    # S = Σ_j γ^(N-1-j) φ(k_j) v_jᵀ  =>  dS/dv_j summed = γ^(N-1-j) Σ_f φ(k_j)_f
    gamma = kern.log_gamma.exp()
    weights = gamma[:, None] ** torch.arange(11, -1, -1, dtype=f64)[None]
    expected_dv = (weights[None, :, :, None] * fk.sum(-1, keepdim=True)).expand_as(v)
    torch.testing.assert_close(v.grad, expected_dv, atol=1e-12, rtol=1e-10)
    assert torch.isfinite(k.grad).all() and k.grad.abs().sum() > 0


def test_taylor_feature_backward_gradcheck():
    """The hand-written backward of the Taylor feature map against finite differences."""
    xs = torch.randn(2, 3, 5, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(taylor.TaylorFeatures.apply, (xs,))


@pytest.mark.parametrize("is_query", [True, False], ids=["query", "key"])
def test_performer_feature_backward_gradcheck(is_query):
    """The hand-written FAVOR+ feature backward against finite differences; for keys, one exponent sits
    above the cap of 60 (a long ω row and x along it), where the feature is flat."""
    gen = torch.Generator().manual_seed(8)
    omega = torch.randn(7, 4, generator=gen, dtype=f64)
    x = torch.randn(3, 5, 4, generator=gen, dtype=f64)
    if not is_query:
        omega[0] = 12 * omega[0] / omega[0].norm()  # max over x of ω₀ᵀx - s||x||²/2 is 144 at x = 24 ω̂₀
        x[0, 0] = 24 * omega[0] / omega[0].norm()
        _, uncapped = performer.positive_random_features(x, omega, 0.5, False, 7, 1e-3)
        assert not uncapped[0, 0, 0] and uncapped.sum() > 0
    x.requires_grad_(True)

    def fn(t):
        return performer.PositiveRandomFeatures.apply(t, omega, 0.5, is_query, 7, 1e-3)

    assert torch.autograd.gradcheck(fn, (x,))
