"""Every attention kernel against an independent float64 brute-force reference (tests/kernels/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_kernel_attn.kernels import KERNELS, LayerShape, build_kernel
from hf_kernel_attn.kernels.feature_maps.elu import EluKernel, positive_elu
from hf_kernel_attn.kernels.linear import PastKeys
from tests.kernels import reference as ref
from tests.kernels.helpers import (  # noqa: F401
    DV,
    LINEAR,
    PARAMS,
    SCALING,
    D,
    make_inputs,
    make_kernel,
    make_mask,
    randomize_parameters,
)

ALL = sorted(KERNELS)
ATOL = RTOL = 1e-4


def skip_causal_only(name, causal):
    """Kernels whose memory is a recurrence over the tokens in order (the delta rule) have no bidirectional form;
    tests/kernels/test_delta_rule.py checks the ValueError they raise."""
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")


def check(kern, q, k, v, key_mask, causal, scaling, atol=ATOL, rtol=RTOL):
    out = kern(q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
    b, hq, n, _ = q.shape
    assert out.shape == (b, n, hq, v.shape[-1])
    assert out.dtype == q.dtype
    expected = ref.reference(kern, q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
    rows = ref.real_queries(b, n, k.shape[-2], causal, key_mask)
    assert rows.any()
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=atol, rtol=rtol)
    return out


# ------------------------------------------------------------------------ the main agreement matrix


@pytest.mark.parametrize("nm", [(7, 7), (5, 13)], ids=["N=M", "N<M"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", ALL)
def test_matches_reference(name, causal, padded, heads, nm):
    skip_causal_only(name, causal)
    n, m = nm
    hq, hkv = heads
    if name == "skyformer" and (causal or n != m):
        pytest.skip("skyformer: bidirectional self-attention only (causal covered by test_skyformer_rejects_causal)")
    kern = make_kernel(name, hq, hkv)
    q, k, v = make_inputs(2, hq, hkv, n, m)
    mask = make_mask(2, m, causal) if padded else None
    check(kern, q, k, v, mask, causal, SCALING)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", ALL)
def test_default_scaling(name, causal):
    """scaling=None means D^-1/2."""
    skip_causal_only(name, causal)
    if name == "skyformer" and causal:
        pytest.skip("bidirectional only")
    kern = make_kernel(name, 4, 2)
    q, k, v = make_inputs(2, 4, 2, 6, 6, seed=3)
    check(kern, q, k, v, make_mask(2, 6, causal, pad=2), causal, None)


@pytest.mark.parametrize("params", [{"sigma": 1.7}, {"normalize": False}, {"sigma": 2.5, "normalize": False},
                                    {"learnable": False}],
                         ids=["sigma", "unnormalized", "sigma-unnormalized", "fixed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_gaussian_options(params, causal):
    kern = make_kernel("gaussian", 4, 2, params)
    q, k, v = make_inputs(2, 4, 2, 6, 9, seed=5)
    check(kern, q, k, v, make_mask(2, 9, causal), causal, SCALING)


@pytest.mark.parametrize("scaling", [SCALING, None], ids=["scaling", "default-scaling"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("nm", [(7, 7), (5, 13)], ids=["N=M", "N<M"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_gaussian_augment_is_softmax(causal, nm, padded, scaling):
    """The augmented Gaussian equals plain softmax(s q·k) exactly (docs/kernels.md §1)."""
    n, m = nm
    kern = make_kernel("gaussian", 4, 2, {"augment": True}, randomize=False)
    q, k, v = make_inputs(2, 4, 2, n, m, seed=7)
    k = k * torch.linspace(0.2, 2.0, m)[None, None, :, None]  # spread of key norms
    mask = make_mask(2, m, causal) if padded else None
    out = kern(q, k, v, key_mask=mask, causal=causal, scaling=scaling)
    s = D**-0.5 if scaling is None else scaling
    expected = ref.per_head_softmax_ref(q, k, v, torch.full((4,), s), key_mask=mask, causal=causal)
    rows = ref.real_queries(2, n, m, causal, mask)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=ATOL, rtol=RTOL)


def test_gaussian_augment_with_gain():
    """With a per-head bandwidth the identity gives softmax with the per-head scale s·exp(log_gain)."""
    kern = make_kernel("gaussian", 4, 2, {"augment": True}, randomize=False)
    with torch.no_grad():
        kern.log_gain.copy_(torch.tensor([-0.5, 0.0, 0.3, 0.7]))
    q, k, v = make_inputs(2, 4, 2, 6, 6, seed=8)
    out = kern(q, k, v, causal=True, scaling=SCALING)
    expected = ref.per_head_softmax_ref(q, k, v, SCALING * kern.log_gain.detach().exp(), causal=True)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("params", [{"gain": 3.0}, {"length": 100}], ids=["gain", "length"])
def test_cosine_gain_init(params):
    kern = make_kernel("cosine", 2, 2, params, randomize=False)
    g = params.get("gain", math.log2(100 * 100 - 100))
    torch.testing.assert_close(kern.log_gain.detach().exp(), torch.full((2,), g))
    q, k, v = make_inputs(1, 2, 2, 6, 6, seed=9)
    check(kern, q, k, v, None, True, SCALING)


# ------------------------------------------------------------------------- long sequences / chunks


@pytest.mark.parametrize("chunk", [None, 7], ids=["chunk64", "chunk7"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", LINEAR)
def test_linear_long_sequence(name, causal, chunk):
    """N = 150 > chunk size: the chunked scan (and dijiang's two-way scan) across many chunks."""
    skip_causal_only(name, causal)
    params = {} if chunk is None else {"chunk_size": chunk}
    kern = make_kernel(name, 4, 2, params, max_positions=400)
    q, k, v = make_inputs(2, 4, 2, 150, 150, seed=11)
    check(kern, q, k, v, make_mask(2, 150, causal, pad=10), causal, SCALING)


@pytest.mark.parametrize("chunk", [None, 7], ids=["chunk64", "chunk7"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", LINEAR)
def test_linear_long_prefix(name, causal, chunk):
    """N < M with a prefix longer than a chunk (causal: prefix folded into the state)."""
    skip_causal_only(name, causal)
    params = {} if chunk is None else {"chunk_size": chunk}
    kern = make_kernel(name, 4, 2, params, max_positions=400)
    q, k, v = make_inputs(2, 4, 2, 20, 150, seed=12)
    check(kern, q, k, v, make_mask(2, 150, causal, pad=10), causal, SCALING)


@pytest.mark.parametrize("name", LINEAR)
def test_linear_prefill_then_decode(name):
    """Causal prefill returning the state, then chunks and single decode steps continuing from it."""
    kern = make_kernel(name, 4, 2, {"chunk_size": 5}, max_positions=64)
    q, k, v = make_inputs(2, 4, 2, 23, 23, seed=13)
    expected = ref.reference(kern, q, k, v, causal=True, scaling=SCALING)
    outs = []
    _, state = kern.forward_with_state(q[:, :, :11], k[:, :, :11], v[:, :, :11], causal=True, scaling=SCALING)
    outs.append(kern(q[:, :, :11], k[:, :, :11], v[:, :, :11], causal=True, scaling=SCALING))
    pos = 11
    for step in (6, 1, 1, 4):
        sl = slice(pos, pos + step)
        out, state = kern.forward_with_state(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True,
                                             scaling=SCALING, past=PastKeys(state, pos))
        outs.append(out)
        pos += step
    assert pos == 23
    torch.testing.assert_close(torch.cat(outs, 1).double(), expected, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------ skyformer


def test_skyformer_rejects_causal():
    kern = make_kernel("skyformer", 2, 2)
    q, k, v = make_inputs(1, 2, 2, 6, 6)
    with pytest.raises(ValueError, match="bidirectional"):
        kern(q, k, v, causal=True, scaling=SCALING)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("params", [{"num_landmarks": 16}, {"num_landmarks": 10, "normalize": False},
                                    {"num_landmarks": 7, "ridge": 0.5}],
                         ids=["16", "10-unnormalized", "7-ridge"])
def test_skyformer_nystrom_longer(params, padded):
    """A real low-rank approximation (landmarks ≪ 2N) against the explicit Nyström."""
    kern = make_kernel("skyformer", 4, 2, {"newton_iters": 30, **params})
    q, k, v = make_inputs(2, 4, 2, 40, 40, seed=14)
    check(kern, q, k, v, make_mask(2, 40, False, pad=9) if padded else None, False, SCALING)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_skyformer_full_landmarks_is_exact_gaussian(padded):
    """With every query and key a landmark, Nyström is exact up to the ridge:
    κ(Q,X)(G + λI)⁻¹κ(X,K) = [G - λ G(G + λI)⁻¹]_QK, an entrywise error ≤ λ = 1e-6 in exact
    arithmetic. What remains is fp32 round-off (~6e-8) in the Newton–Schulz inverse, amplified by
    the condition number of G (about 36 here: s^1/2-scaled random points are far apart, so G ≈ I),
    i.e. ~1e-5 at most (observed 8e-7); 1e-4 is above that and far below the difference to any
    other kernel (softmax differs by 0.7)."""
    n = 12
    kern = make_kernel("skyformer", 4, 2, {"num_landmarks": 2 * n, "ridge": 1e-6, "newton_iters": 30})
    q, k, v = make_inputs(2, 4, 2, n, n, seed=15)
    mask = make_mask(2, n, False, pad=4) if padded else None
    out = kern(q, k, v, key_mask=mask, causal=False, scaling=SCALING)
    expected = ref.exact_gaussian_ref(q, k, v, key_mask=mask, scaling=SCALING)
    rows = ref.real_queries(2, n, n, False, mask)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=1e-4, rtol=1e-4)


def test_skyformer_rejects_cross_attention():
    kern = make_kernel("skyformer", 2, 2)
    q, k, v = make_inputs(1, 2, 2, 5, 7)
    with pytest.raises(ValueError):
        kern(q, k, v, causal=False, scaling=SCALING)


# ------------------------------------------------------------------------ gradients and precision


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", ALL)
def test_backward_finite(name, causal):
    skip_causal_only(name, causal)
    if name == "skyformer" and causal:
        pytest.skip("bidirectional only")
    kern = make_kernel(name, 4, 2)
    q, k, v = make_inputs(2, 4, 2, 9, 9, seed=16)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out = kern(q, k, v, key_mask=make_mask(2, 9, causal), causal=causal, scaling=SCALING)
    (out * torch.randn_like(out)).sum().backward()
    tensors = [q, k, v] + [p for p in kern.parameters() if p.requires_grad]
    for t in tensors:
        assert t.grad is not None
        assert torch.isfinite(t.grad).all()
    assert q.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", ALL)
def test_bf16_smoke(name, causal):
    skip_causal_only(name, causal)
    if name == "skyformer" and causal:
        pytest.skip("bidirectional only")
    kern = make_kernel(name, 4, 2)
    q, k, v = make_inputs(2, 4, 2, 9, 9, seed=17)
    mask = make_mask(2, 9, causal)
    out = kern(q.bfloat16(), k.bfloat16(), v.bfloat16(), key_mask=mask, causal=causal, scaling=SCALING)
    assert out.dtype == torch.bfloat16
    assert out.shape == (2, 9, 4, DV)
    assert torch.isfinite(out).all()
    # loose agreement with the fp64 reference on the bf16-rounded inputs
    expected = ref.reference(kern, q.bfloat16(), k.bfloat16(), v.bfloat16(), key_mask=mask, causal=causal,
                             scaling=SCALING)
    rows = ref.real_queries(2, 9, 9, causal, mask)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("x", [-100.0, 100.0])
def test_elu_feature_gradient_finite(x):
    t = torch.tensor([x, x / 2, -x], requires_grad=True)
    phi = positive_elu(t)
    phi.sum().backward()
    assert torch.isfinite(phi).all() and torch.isfinite(t.grad).all()
    expected = [math.exp(min(z, 0.0)) if z <= 0 else 1.0 for z in (x, x / 2, -x)]
    torch.testing.assert_close(t.grad, torch.tensor(expected))
    # through the kernel's feature and the whole kernel as well
    kern = make_kernel("elu", 2, 2)
    assert isinstance(kern, EluKernel)
    xx = torch.full((1, 2, 4, D), x, requires_grad=True)
    kern.feature(xx, None, SCALING).sum().backward()
    assert torch.isfinite(xx.grad).all()
    q = torch.full((1, 2, 4, D), x, requires_grad=True)
    k = torch.full((1, 2, 4, D), x, requires_grad=True)
    v = torch.randn(1, 2, 4, DV, requires_grad=True)
    kern(q, k, v, causal=True, scaling=SCALING).sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()


# ------------------------------------------------------------------------------- fixed parameters


def test_performer_omega_deterministic_per_layer():
    a = make_kernel("performer", 2, 2, {"seed": 3}, layer_idx=1)
    b = make_kernel("performer", 2, 2, {"seed": 3}, layer_idx=1)
    c = make_kernel("performer", 2, 2, {"seed": 3}, layer_idx=2)
    d = make_kernel("performer", 2, 2, {"seed": 4}, layer_idx=1)
    assert torch.equal(a.omega, b.omega)
    assert not torch.allclose(a.omega, c.omega)
    assert not torch.allclose(a.omega, d.omega)
    a.reset_parameters()
    assert torch.equal(a.omega, b.omega)


def test_performer_omega_structure():
    """Default m = floor(D ln D); rows within each D-block are mutually orthogonal."""
    kern = make_kernel("performer", 2, 2, head_dim=16)
    omega = kern.omega.double()
    assert omega.shape == (int(16 * math.log(16)), 16)
    for start in range(0, omega.shape[0], 16):
        block = omega[start:start + 16]
        gram = block @ block.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-4 * gram.diagonal().max()
    assert make_kernel("performer", 2, 2, {"num_features": 37}).omega.shape == (37, D)


def test_performer_omega_isotropic():
    """FAVOR+ needs every ω row marginally N(0, I): zero mean, E[ωωᵀ] = I, E||ω||² = D.
    (QR without fixing the signs of diag(R) gives block row j a mean of about -0.75 e_j.)"""
    d, m = 4, 4096
    omega = make_kernel("performer", 1, 1, {"num_features": m}, head_dim=d).omega.double()
    blocks = omega.view(m // d, d, d)
    se = 1 / math.sqrt(m // d)  # standard error of a block-position mean
    assert blocks.mean(0).abs().max() < 5 * se
    assert omega.mean(0).abs().max() < 5 / math.sqrt(m)
    torch.testing.assert_close(omega.T @ omega / m, torch.eye(d, dtype=torch.float64), atol=0.1, rtol=0)


def test_performer_approximates_softmax():
    """The random features themselves: with many features (and ε's negligible) the row-normalised
    kernel ≈ softmax(s q·k). The estimator is heavy-tailed, so take the median over seeds."""
    torch.manual_seed(18)
    q = 0.5 * torch.randn(1, 2, 10, 4)
    k = 0.5 * torch.randn(1, 2, 10, 4)
    v = torch.randn(1, 2, 10, DV)
    expected = ref.softmax_ref(None, q, k, v, causal=False, scaling=0.5)
    errors = []
    for seed in range(7):
        kern = make_kernel("performer", 2, 2, {"num_features": 4096, "feature_eps": 1e-12, "eps": 1e-30,
                                               "seed": seed}, head_dim=4)
        out = kern(q, k, v, causal=False, scaling=0.5)
        errors.append((out.double() - expected).abs().max().item())
    assert sorted(errors)[len(errors) // 2] < 0.05, errors


def test_performer_keys_not_swamped_by_feature_eps():
    d, n = 64, 32
    kern = make_kernel("performer", 1, 1, head_dim=d)
    torch.manual_seed(21)
    q = torch.randn(1, 1, n, d)
    k = torch.randn(1, 1, n, d)
    v = torch.randn(1, 1, n, DV)
    out = kern(q, k, v, causal=False)
    mean_pool = v.mean(2, keepdim=True).expand(-1, -1, n, -1).transpose(1, 2)
    assert (out - mean_pool).abs().max() > 1e-2


def test_dijiang_parameters():
    """projection = DCT-IIᵀ · diag(w) (orthogonal columns), γ_h = 1 - exp(linspace(ln 1/32, ln 1/512, Hkv))."""
    kern = make_kernel("dijiang", 8, 4)
    p = kern.projection.double()
    dn = torch.arange(D, dtype=torch.float64)
    dct = torch.cos(math.pi * (dn[None, :] + 0.5) * dn[:, None] / D) * math.sqrt(2 / D)
    dct[0] /= math.sqrt(2)
    w = dct @ p  # = diag(w) if projection = Cᵀ diag(w)
    torch.testing.assert_close(w, torch.diag(torch.diagonal(w)), atol=1e-5, rtol=0)
    assert torch.diagonal(w).abs().min() > 0
    gam = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), 4, dtype=torch.float64))
    torch.testing.assert_close(kern.log_gamma.double().exp(), gam, atol=1e-6, rtol=0)
    same = make_kernel("dijiang", 8, 4)
    other = make_kernel("dijiang", 8, 4, layer_idx=1)
    assert torch.equal(same.projection, kern.projection)
    assert not torch.allclose(other.projection, kern.projection)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_dijiang_no_overflow_long(causal):
    """Positions up to 10000: γ^(i-j) from differences never overflows (γ^-m would for γ = 31/32
    beyond ~2800 in fp32). Checks finiteness everywhere and the last rows against the reference."""
    n = 10000
    kern = make_kernel("dijiang", 2, 1, {"chunk_size": 256}, head_dim=4)
    torch.manual_seed(19)
    q = torch.randn(1, 2, n, 4)
    k = torch.randn(1, 1, n, 4)
    v = torch.randn(1, 1, n, 2)
    out = kern(q, k, v, causal=causal, scaling=0.5)
    assert torch.isfinite(out).all()
    if causal:
        last = 8
        expected = ref.dijiang_ref(kern, q[:, :, -last:], k, v, causal=True, scaling=0.5)
        torch.testing.assert_close(out[:, -last:].double(), expected, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------ errors


def test_unknown_kernel():
    with pytest.raises(ValueError, match="available kernels") as info:
        build_kernel("nope", LayerShape(2, 2, D))
    for name in KERNELS:
        assert name in str(info.value)


@pytest.mark.parametrize("name", ALL)
def test_unknown_option(name):
    with pytest.raises(ValueError, match="valid options") as info:
        build_kernel(name, LayerShape(2, 2, D), {"bogus_option": 1})
    assert "bogus_option" in str(info.value)


@pytest.mark.parametrize(
    "name,params",
    [
        ("gaussian", {"sigma": 0}),
        ("gaussian", {"sigma": -1.0}),
        ("gaussian", {"augment": True, "normalize": False}),
        ("performer", {"num_features": 0}),
        ("performer", {"num_features": -3}),
        ("performer", {"feature_eps": 0}),
        ("cosine", {"gain": 0}),
        ("cosine", {"length": 1}),
        ("skyformer", {"num_landmarks": 1}),
        ("skyformer", {"ridge": 0}),
        ("cosformer", {"horizon": 0}),
        ("hedgehog", {"feature_dim": 0}),
        ("dijiang", {"decay": "yes"}),
        ("taylor", {"quadratic_below": -1}),
        ("taylor", {"quadratic_below": 2.0}),
    ]
    + [(name, {"chunk_size": 0}) for name in LINEAR]
    + [(name, {"chunk_size": 2.5}) for name in LINEAR[:1]]
    + [(name, {"eps": 0}) for name in LINEAR[:1]],
)
def test_invalid_values(name, params):
    with pytest.raises(ValueError):
        build_kernel(name, LayerShape(2, 2, D), params)


def test_gqa_head_mismatch():
    kern = make_kernel("softmax", 3, 3)
    q = torch.randn(1, 3, 4, D)
    k = torch.randn(1, 2, 4, D)
    with pytest.raises(ValueError):
        kern(q, k, k, causal=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_cosformer_rejects_positions_beyond_horizon(causal):
    """Past the horizon the cosine re-weighting turns negative: a clear error, not silent garbage."""
    kern = make_kernel("cosformer", max_positions=32)
    q, k, v = make_inputs(1, 4, 2, 33, 33)
    with pytest.raises(ValueError, match="horizon M = 32.*horizon=33"):
        kern(q, k, v, causal=causal, scaling=SCALING)
    with torch.no_grad(), pytest.raises(ValueError, match="horizon"):
        kern(q, k, v, causal=causal, scaling=SCALING)
    check(make_kernel("cosformer", params={"horizon": 40}, max_positions=32), q, k, v, None, causal, SCALING)
    # decoding: the step that would cross the horizon raises
    kern = make_kernel("cosformer", max_positions=32)
    _, state = kern.forward_with_state(q[:, :, :32], k[:, :, :32], v[:, :, :32], causal=True, scaling=SCALING)
    with pytest.raises(ValueError, match="horizon"):
        kern.forward_with_state(q[:, :, 32:], k[:, :, 32:], v[:, :, 32:], causal=True, scaling=SCALING,
                                past=PastKeys(state, 32))


@pytest.mark.parametrize("quadratic_below", [0, 10**6], ids=["scan", "quadratic"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_taylor_quadratic_and_scan_paths(quadratic_below, heads):
    """Both causal evaluation orders of taylor (forced by quadratic_below) against the reference, the
    state each returns, and decoding continued from it."""
    hq, hkv = heads
    kern = make_kernel("taylor", hq, hkv, {"chunk_size": 7, "quadratic_below": quadratic_below}, max_positions=400)
    assert kern.quadratic_is_cheaper(*make_inputs(1, hq, hkv, 150, 150), True) == bool(quadratic_below)
    q, k, v = make_inputs(2, hq, hkv, 154, 154, seed=21)
    mask = make_mask(2, 154, True, pad=10)
    with torch.no_grad():
        check(kern, q[:, :, :150], k[:, :, :150], v[:, :, :150], mask[:, :150], True, SCALING)
        out, state = kern.forward_with_state(q[:, :, :150], k[:, :, :150], v[:, :, :150], key_mask=mask[:, :150],
                                             causal=True, scaling=SCALING)
        steps = [out]
        for pos in range(150, 154):
            sl = slice(pos, pos + 1)
            step, state = kern.forward_with_state(q[:, :, sl], k[:, :, sl], v[:, :, sl], key_mask=mask[:, sl],
                                                  causal=True, scaling=SCALING, past=PastKeys(state, pos))
            steps.append(step)
    expected = ref.reference(kern, q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    rows = ref.real_queries(2, 154, 154, True, mask)
    torch.testing.assert_close(torch.cat(steps, 1).double()[rows], expected[rows], atol=ATOL, rtol=RTOL)


def test_taylor_cost_model_picks_quadratic_for_short_sequences():
    kern = make_kernel("taylor", 8, 8, head_dim=64, max_positions=65536)
    short, long = (torch.zeros(1, 8, n, 64) for n in (1024, 16384))
    assert kern.quadratic_is_cheaper(short, short, short, False)
    assert not kern.quadratic_is_cheaper(long, long, long, False)


# ------------------------------------------------------------------- short-sequence dispatch


def _taylor_bidirectional_switch(hq, hkv):
    """The smallest N (= M) at which taylor's bidirectional cost model leaves the quadratic form."""
    kern = make_kernel("taylor", hq, hkv)
    for n in range(1, 4096):
        x = torch.zeros(1, hq, n, D)
        if not kern.quadratic_is_cheaper(x, x[:, :hkv], torch.zeros(1, hkv, n, DV), False, causal=False):
            return n
    raise AssertionError("no switch below 4096")


@pytest.mark.parametrize("quadratic_below", [0, 10**6], ids=["features", "quadratic"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_taylor_bidirectional_paths(quadratic_below, heads):
    """Both bidirectional evaluation orders of taylor (forced by quadratic_below), padded, vs the reference."""
    hq, hkv = heads
    kern = make_kernel("taylor", hq, hkv, {"quadratic_below": quadratic_below}, max_positions=64)
    q, k, v = make_inputs(2, hq, hkv, 30, 30, seed=41)
    with torch.no_grad():
        check(kern, q, k, v, make_mask(2, 30, False, pad=7), False, SCALING)


@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_taylor_bidirectional_switch_boundary(heads):
    """At the cost model's switch N* - 1 (quadratic) and N*, N* + 1 (features) the output equals the reference."""
    hq, hkv = heads
    switch = _taylor_bidirectional_switch(hq, hkv)
    assert 8 < switch < 200  # D = 8: F = 45 features, so the switch sits at a few dozen tokens
    kern = make_kernel("taylor", hq, hkv, max_positions=256)
    for n in (switch - 1, switch, switch + 1):
        q, k, v = make_inputs(2, hq, hkv, n, n, seed=n)
        assert kern.quadratic_is_cheaper(q, k, v, False, causal=False) == (n < switch)
        with torch.no_grad():
            check(kern, q, k, v, make_mask(2, n, False, pad=5), False, SCALING)


def test_taylor_bidirectional_cost_model_at_encoder_lengths():
    """MiniLM's shape (12 heads, D = 32): quadratic up to a few hundred tokens, features at 4k."""
    kern = make_kernel("taylor", 12, 12, head_dim=32, max_positions=8192)
    short, long = (torch.zeros(1, 12, n, 32) for n in (128, 4096))
    assert kern.quadratic_is_cheaper(short, short, short, False, causal=False)
    assert not kern.quadratic_is_cheaper(long, long, long, False, causal=False)


def test_skyformer_exact_form_is_exact_gaussian():
    """form='exact' (any N, here above the landmark count) equals the exact row-normalised Gaussian, padded;
    unnormalised too."""
    n = 20
    q, k, v = make_inputs(2, 4, 2, n, n, seed=42)
    mask = make_mask(2, n, False, pad=6)
    rows = ref.real_queries(2, n, n, False, mask)
    kern = make_kernel("skyformer", 4, 2, {"form": "exact", "num_landmarks": 4})
    out = kern(q, k, v, key_mask=mask, causal=False, scaling=SCALING)
    expected = ref.exact_gaussian_ref(q, k, v, key_mask=mask, scaling=SCALING)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=ATOL, rtol=RTOL)
    raw = make_kernel("skyformer", 4, 2, {"form": "exact", "normalize": False})
    out = raw(q, k, v, key_mask=mask, causal=False, scaling=SCALING)
    expected = ref.exact_gaussian_ref(q, k, v, key_mask=mask, scaling=SCALING, normalize=False)
    torch.testing.assert_close(out.double()[rows], expected[rows], atol=ATOL, rtol=RTOL)


def test_skyformer_auto_form_boundaries():
    """form='auto': N = landmarks - 1, landmarks (exact), and at the cost model's switch N* - 1 (exact) and
    N*, N* + 1 (Nyström) -- each against its own brute-force reference."""
    from hf_kernel_attn.kernels.skyformer import exact_is_cheaper

    params = {"num_landmarks": 8, "newton_iters": 30, "form": "auto"}
    kern = make_kernel("skyformer", 4, 2, params)
    switch = next(n for n in range(2, 4096) if not exact_is_cheaper(n, D, DV, 8, 30))
    assert switch > 9
    for n in (7, 8, 9, switch - 1, switch, switch + 1):
        q, k, v = make_inputs(2, 4, 2, n, n, seed=100 + n)
        mask = make_mask(2, n, False, pad=3)
        exact = kern.uses_exact(n, D, DV)
        assert exact == (n < switch)
        out = kern(q, k, v, key_mask=mask, causal=False, scaling=SCALING)
        if exact:
            expected = ref.exact_gaussian_ref(q, k, v, key_mask=mask, scaling=SCALING)
        else:
            expected = ref.skyformer_ref(kern, q, k, v, key_mask=mask, scaling=SCALING)
        rows = ref.real_queries(2, n, n, False, mask)
        torch.testing.assert_close(out.double()[rows], expected[rows], atol=ATOL, rtol=RTOL)


def test_skyformer_default_form_is_exact_at_minilm_lengths():
    """Defaults (64 landmarks, 6 Newton steps) on MiniLM's head dim: exact at 45 and 128 tokens, Nyström at 4k."""
    kern = make_kernel("skyformer", 12, 12, {"form": "auto", "num_landmarks": 64, "newton_iters": 6}, head_dim=32)
    assert kern.uses_exact(45, 32, 32) and kern.uses_exact(128, 32, 32)
    assert not kern.uses_exact(4096, 32, 32)
