"""The gated scan (kernels/linear/gated.py) against a float64 token-by-token recurrence written here, its hand-written
backward against autograd through that recurrence and against finite differences, and the gated kernels' gates
against transformers' own rotary embeddings (a gate computed from RoPE-rotated keys must not depend on the
position)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

from hf_kernel_attn.kernels import LayerShape, build_kernel
from hf_kernel_attn.kernels.linear.gated import GatedScan, gated_causal

f64 = torch.float64


def recurrence(fq, fk, v1, log_gate, s0):
    """S_t = diag(α_t) S_{t-1} + φ(k_t) v1_tᵀ, o_t = φ(q_t)ᵀ S_t, one token at a time; feature f decays by gate
    f mod Γ."""
    f = fq.shape[-1]
    alpha = torch.exp(log_gate)
    alpha = torch.cat([alpha] * (f // alpha.shape[-1]), -1) if alpha.shape[-1] != f else alpha
    s, outs = s0, []
    for t in range(fq.shape[-2]):
        s = alpha[:, :, t, :, None] * s + fk[:, :, t, :, None] * v1[:, :, t, None, :]
        outs.append(torch.einsum("bhgf,bhfe->bhge", fq[:, :, :, t], s))
    return torch.stack(outs, 3), s


def _inputs(n, gates, seed=0, f=6, g=2, e=3):
    gen = torch.Generator().manual_seed(seed)
    fq = torch.rand(2, 2, g, n, f, generator=gen, dtype=f64)
    fk = torch.rand(2, 2, n, f, generator=gen, dtype=f64)
    v1 = torch.randn(2, 2, n, e, generator=gen, dtype=f64)
    log_gate = -1.25 * torch.rand(2, 2, n, gates, generator=gen, dtype=f64)
    s0 = torch.randn(2, 2, f, e, generator=gen, dtype=f64)
    return [x.requires_grad_() for x in (fq, fk, v1, log_gate, s0)]


@pytest.mark.parametrize("gates", [6, 3, 1], ids=["per-feature", "tiled", "per-head"])
@pytest.mark.parametrize("n,chunk", [(8, 7), (8, 8), (8, 9), (17, 4), (1, 4)])
def test_scan_equals_the_recurrence_in_outputs_and_gradients(gates, n, chunk):
    inputs = _inputs(n, gates)
    out, final = gated_causal(*inputs, chunk)
    ref_out, ref_final = recurrence(*inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    grads = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * w_out).sum() + (ref_final * w_final).sum(), inputs)
    for name, a, b in zip(["q", "k", "v", "gates", "state"], grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


def test_backward_matches_finite_differences():
    inputs = _inputs(7, 2, seed=1, f=4, g=1, e=2)
    assert torch.autograd.gradcheck(lambda *x: GatedScan.apply(*x, 3), inputs)


def test_strong_gates_at_the_clamp_stay_finite_in_fp32():
    """Every gate at the clamp (log α = -1.25) over a 64-token chunk: the factors reach e^{±40}; outputs and
    gradients stay finite and equal the float64 recurrence."""
    fq, fk, v1, log_gate, s0 = (x.detach() for x in _inputs(64, 6, seed=2))
    log_gate = torch.full_like(log_gate, -1.25)
    inputs32 = [x.float().requires_grad_() for x in (fq, fk, v1, log_gate, s0)]
    out, final = gated_causal(*inputs32, 64)
    ref_out, _ = recurrence(fq, fk, v1, log_gate, s0)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.sum() + final.sum(), inputs32)
    assert all(torch.isfinite(gr).all() for gr in grads)


# --------------------------------------------------------------------------- gates under transformers' RoPE
def _llama_rotate(k, positions, base=10000.0):
    d = k.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None]
    emb = torch.cat([angles, angles], -1)
    _, rotated = llama_rotary(k, k, emb.cos()[None], emb.sin()[None])
    return rotated


def _gptj_rotate(k, positions):
    table = create_sinusoidal_positions(4096, k.shape[-1])
    sin, cos = torch.split(table[positions], k.shape[-1] // 2, dim=-1)
    # GPT-J's helper takes [B, N, H, D] and sin/cos [B, N, D/2]
    return gptj_rotary(k.transpose(1, 2), sin[None], cos[None]).transpose(1, 2)


@pytest.mark.parametrize("name", ["liger", "gla"])
@pytest.mark.parametrize("rope_pairs,rotate", [("half", _llama_rotate), ("interleaved", _gptj_rotate)])
def test_gates_do_not_depend_on_the_position(name, rope_pairs, rotate):
    kern = build_kernel(name, LayerShape(4, 2, 16), {"rope_pairs": rope_pairs})
    if name == "gla":
        with torch.no_grad():
            kern.gate_up.normal_()  # gates that vary with the key (they start constant)
    k = torch.randn(1, 2, 5, 16)
    near = kern.gates(rotate(k, torch.arange(5)), 0.25)
    far = kern.gates(rotate(k, torch.arange(1000, 1005)), 0.25)
    assert near.std() > 1e-3
    torch.testing.assert_close(near, far, rtol=1e-4, atol=1e-5)


def test_rope_pairs_must_be_a_known_pairing():
    with pytest.raises(ValueError, match="rope_pairs='paired'.*half, interleaved"):
        build_kernel("liger", LayerShape(4, 2, 16), {"rope_pairs": "paired"})


@pytest.mark.parametrize("head_dim", [8, 7])
@pytest.mark.parametrize("rope_pairs", ["half", "interleaved"])
def test_liger_features_and_gates_without_grad_equal_the_formula(head_dim, rope_pairs):
    """liger's in-place inference path (no autograd) gives φ(x) = [softmax(s^1/2 x), softmax(-s^1/2 x)] (per RoPE
    pair order, zero-padded for odd D) and log σ(bias + s^1/2 ρ) as written here in float64, and so does its
    autograd path."""
    kern = build_kernel("liger", LayerShape(2, 2, head_dim, layer_idx=0, max_positions=64),
                        {"rope_pairs": rope_pairs})
    gen = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(1, 2, 5, head_dim, generator=gen)
    scaling = head_dim**-0.5
    order = list(range(head_dim)) if rope_pairs == "half" else [*range(0, head_dim, 2), *range(1, head_dim, 2)]
    h = x.double()[..., order] * scaling**0.5
    pad = (0, head_dim % 2)
    want = torch.cat([torch.nn.functional.pad(torch.softmax(h, -1), pad),
                      torch.nn.functional.pad(torch.softmax(-h, -1), pad)], -1)
    hp = torch.nn.functional.pad(x.double()[..., order], pad)
    half = hp.shape[-1] // 2
    rho = (hp[..., :half] ** 2 + hp[..., half:] ** 2).sqrt() * scaling**0.5
    want_gate = torch.nn.functional.logsigmoid(kern.options.gate_bias + rho).clamp_min(-1.25)
    pos = torch.arange(5)
    with torch.no_grad():
        torch.testing.assert_close(kern.feature(x, pos, scaling).double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kern.gates(x, scaling).double(), want_gate, rtol=1e-5, atol=1e-6)
    xg = x.clone().requires_grad_()
    torch.testing.assert_close(kern.feature(xg, pos, scaling).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kern.gates(xg, scaling).double(), want_gate, rtol=1e-5, atol=1e-6)
