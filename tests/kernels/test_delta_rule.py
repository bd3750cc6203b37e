"""DeltaNet and Gated DeltaNet (kernels ``deltanet``, ``gated_deltanet``) against an independent float64 brute
force: delta_rule_reference.py, a plain Python loop over the papers' recurrence (Schlag et al. 2021, Yang et al.
2025) that never calls the package's feature maps, gates or delta-rule forms."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS, LayerShape, build_kernel
from hf_kernel_attn.kernels.linear import PastKeys
from tests.compat import cache_arg, needs_state_cache
from tests.kernels.delta_rule_reference import brute_force

NAMES = ["deltanet", "gated_deltanet"]
D, DV = 8, 5
SCALING = 0.3
f64 = torch.float64


# ------------------------------------------------------------------------------------------ helpers


def make(name, hq=4, hkv=2, params=None, head_dim=D, randomize=True):
    kern = build_kernel(name, LayerShape(hq, hkv, head_dim, 0, 256), dict(params or {}))
    if randomize:  # parameters away from their init, so β and α vary per token and head
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in kern.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
            if name == "gated_deltanet":  # decays that matter: α well below 1
                kern.gate_bias.fill_(0.5)
                kern.gate_up.mul_(4)
    return kern


def inputs(b, hq, hkv, n, m, seed=0, dtype=torch.float32, head_dim=D):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, head_dim, generator=gen, dtype=f64)
    k = torch.randn(b, hkv, m, head_dim, generator=gen, dtype=f64)
    v = torch.randn(b, hkv, m, DV, generator=gen, dtype=f64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def left_padding(b, m, pad=3):
    mask = torch.ones(b, m, dtype=torch.bool)
    mask[1, :pad] = False
    return mask


def real_rows(out, mask, n, m):
    """Outputs of real query rows only ([B, N, H, Dv] -> flat)."""
    if mask is None:
        return out
    return out[mask[:, m - n:]]


def close(got, want, mask=None, n=None, m=None, atol=2e-5, rtol=2e-5):
    got, want = got.detach().double(), want.detach().double()
    if mask is not None:
        got, want = real_rows(got, mask, n, m), real_rows(want, mask, n, m)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------ the math


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("nm", [(9, 9), (5, 13), (12, 30)], ids=["N=M", "N<M", "N<M-chunked-from-state"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("name", NAMES)
def test_causal_matches_brute_force(name, padded, heads, nm, grad):
    n, m = nm
    hq, hkv = heads
    kern = make(name, hq, hkv, {"chunk_size": 4})
    q, k, v = inputs(2, hq, hkv, n, m, seed=n + hq)
    mask = left_padding(2, m) if padded else None
    q.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = kern(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    assert out.shape == (2, n, hq, DV) and out.dtype == torch.float32
    close(out, brute_force(kern, q, k, v, mask, SCALING), mask, n, m)


@pytest.mark.parametrize("feature_map", ["silu", "elu", "hedgehog"])
@pytest.mark.parametrize("name", NAMES)
def test_feature_maps_and_fixed_beta(name, feature_map):
    kern = make(name, 4, 2, {"feature_map": feature_map, "chunk_size": 4})
    q, k, v = inputs(2, 4, 2, 11, 11, seed=5)
    close(kern(q, k, v, causal=True, scaling=SCALING), brute_force(kern, q, k, v, None, SCALING))
    if feature_map == "hedgehog":  # learnable maps: gradients reach them, decoding runs on the 2D-wide memory
        assert kern.num_features() == 2 * D
        leaf = q.clone().requires_grad_(True)
        kern(leaf, k, v, causal=True, scaling=SCALING).sum().backward()
        assert kern.weight_q.grad.abs().sum() > 0 and kern.bias_k.grad.abs().sum() > 0
        with torch.no_grad():
            _, state = kern.forward_with_state(q[:, :, :10], k[:, :, :10], v[:, :, :10], causal=True,
                                               scaling=SCALING)
            last, state = kern.forward_with_state(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], causal=True,
                                                  scaling=SCALING, past=PastKeys(state, 10))
        assert state.S.shape == (2, 2, 2 * D, DV)
        close(last, brute_force(kern, q, k, v, None, SCALING)[:, 10:])
    fixed = make(name, 4, 2, {"beta": 0.7, "chunk_size": 4})
    assert not hasattr(fixed, "beta_weight")
    close(fixed(q, k, v, causal=True), brute_force(fixed, q, k, v))


@pytest.mark.parametrize("name", NAMES)
def test_default_scaling_and_odd_head_dim(name):
    kern = make(name, 3, 1, {"chunk_size": 4}, head_dim=7)
    q, k, v = inputs(2, 3, 1, 10, 10, seed=2, head_dim=7)
    close(kern(q, k, v, causal=True), brute_force(kern, q, k, v))


@pytest.mark.parametrize("n", [15, 16, 17, 33])
@pytest.mark.parametrize("name", NAMES)
def test_chunk_boundaries(name, n):
    """N = C - 1, C, C + 1 (and two chunks and a bit) with chunk_size C = 16 (above the length below which the
    token recurrence runs instead), against the brute force and across chunk sizes (the chunking changes no
    result)."""
    q, k, v = inputs(2, 4, 2, n, n, seed=n)
    kern = make(name, 4, 2, {"chunk_size": 16})
    want = brute_force(kern, q, k, v, None, SCALING)
    for chunk in (16, 1, 3, 64):
        other = copy.deepcopy(kern)
        other.options.chunk_size = chunk
        close(other(q, k, v, causal=True, scaling=SCALING), want)


GRADIENT_CASES = {"gqa-padded": ((4, 2), 11, {"chunk_size": 4}),
                  "mha-padded": ((3, 3), 11, {"chunk_size": 4}),
                  "chunk-minus-1": ((4, 2), 15, {"chunk_size": 16}),
                  "chunk-plus-1": ((4, 2), 17, {"chunk_size": 16}),
                  "window-sinks-mix": ((4, 2), 17, {"chunk_size": 4, "window": 5, "sinks": 2, "window_mix": True})}


@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
@pytest.mark.parametrize("name", NAMES)
def test_gradients_fp32_against_brute_force(name, case):
    """dq, dk, dv and every parameter's gradient (β's w and c; the gate's W₁, W₂, bias; window_mix) of the fp32
    kernel against autograd through the float64 brute force, on padded batches: GQA and MHA, N = C ± 1 with
    C = 16, and the window + sinks hybrid."""
    (hq, hkv), n, options = GRADIENT_CASES[case]
    kern = make(name, hq, hkv, options)
    if "window_mix" in options:
        with torch.no_grad():
            kern.memory_mix.uniform_(-1.5, 1.5, generator=torch.Generator().manual_seed(2))
    q, k, v = inputs(2, hq, hkv, n, n, seed=21)
    mask = left_padding(2, n)
    weight = torch.randn(2, n, hq, DV, generator=torch.Generator().manual_seed(3), dtype=f64)
    weight = weight * mask[:, :, None, None]  # pad query rows carry no loss
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    params = [p for _, p in sorted(kern.named_parameters())]
    names = [n_ for n_, _ in sorted(kern.named_parameters())]
    want = ["beta_bias", "beta_weight"] if name == "deltanet" else [
        "beta_bias", "beta_weight", "gate_bias", "gate_down", "gate_up"]
    assert names == sorted(want + (["memory_mix"] if "window_mix" in options else []))
    out = kern(*leaves, key_mask=mask, causal=True, scaling=SCALING)
    grads = torch.autograd.grad((out.double() * weight).sum(), [*leaves, *params])
    ref_leaves = [x.double().clone().requires_grad_(True) for x in (q, k, v)]
    ref = brute_force(kern, *ref_leaves, mask, SCALING)
    ref_grads = torch.autograd.grad((ref * weight).sum(), [*ref_leaves, *params])
    for label, g, r in zip(["dq", "dk", "dv", *names], grads, ref_grads, strict=True):
        assert torch.isfinite(g).all(), label
        scale = float(r.abs().max())
        assert scale > 1e-6, f"{label}: the reference gradient vanishes, the check would be vacuous"
        err = float((g.double() - r).abs().max())
        assert err <= 1e-4 * scale + 1e-6, f"{label}: max error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", NAMES)
def test_window_and_sinks_hybrid(name):
    """window=W with sinks=S, a learnt window_mix and key padding: softmax over win(i) ∪ sinks plus the memory
    after key i - W, decayed to i, in both grad modes."""
    kern = make(name, 4, 2, {"window": 5, "sinks": 2, "window_mix": True, "chunk_size": 4})
    with torch.no_grad():
        kern.memory_mix.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(5))
    n = 17
    q, k, v = inputs(2, 4, 2, n, n, seed=4)
    mask = left_padding(2, n)
    want = brute_force(kern, q, k, v, mask, SCALING)
    with torch.no_grad():
        close(kern(q, k, v, key_mask=mask, causal=True, scaling=SCALING), want, mask, n, n)
    leaf = q.clone().requires_grad_(True)
    out = kern(leaf, k, v, key_mask=mask, causal=True, scaling=SCALING)
    close(out, want, mask, n, n)
    out.sum().backward()
    assert torch.isfinite(leaf.grad).all() and kern.memory_mix.grad.abs().sum() > 0
    # N <= W: the exact softmax alone (no memory read yet)
    short = make(name, 4, 2, {"window": 8})
    q, k, v = inputs(1, 4, 2, 8, 8, seed=9)
    ref = torch.softmax(SCALING * q @ k.repeat_interleave(2, 1).transpose(-1, -2)
                        + torch.full((8, 8), float("-inf")).triu(1), -1) @ v.repeat_interleave(2, 1)
    close(short(q, k, v, causal=True, scaling=SCALING), ref.transpose(1, 2))


@pytest.mark.parametrize("name", NAMES)
def test_window_mix_starts_as_the_window_and_sinks_alone(name):
    """With window_mix the memory's factor λ starts at mix_init = 0: a freshly built (untrained) hybrid is exactly
    softmax over each query's last W keys and the S sinks, written out here as one masked softmax; mix_init = 1
    adds the memory (the output differs), and the factor gets a gradient at 0, so training can grow it."""
    window, sinks, n = 5, 2, 17
    kern = build_kernel(name, LayerShape(4, 2, D, 0, 256), {"window": window, "sinks": sinks, "window_mix": True})
    q, k, v = inputs(1, 4, 2, n, n, seed=12)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = (j <= i) & ((i - j < window) | (j < sinks))
    logits = SCALING * q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)
    ref = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1) @ v.double().repeat_interleave(2, 1)
    out = kern(q, k, v, causal=True, scaling=SCALING)
    close(out, ref.transpose(1, 2))
    out.double().pow(2).sum().backward()
    assert kern.memory_mix.grad.abs().sum() > 0
    one = build_kernel(name, LayerShape(4, 2, D, 0, 256), {"window": window, "sinks": sinks, "window_mix": True,
                                                            "mix_init": 1.0})
    with torch.no_grad():
        assert (one(q, k, v, causal=True, scaling=SCALING).double() - ref.transpose(1, 2)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="mix_init must be a finite number"):
        build_kernel(name, LayerShape(4, 2, D, 0, 256), {"window": window, "window_mix": True, "mix_init": "x"})


@pytest.mark.parametrize("params", [{}, {"window": 4, "sinks": 2}], ids=["plain", "window+sinks"])
@pytest.mark.parametrize("name", NAMES)
def test_decoding_token_by_token_equals_full_forward(name, params):
    """Prefill, then one token at a time with forward_with_state as the cache drives it (a window hybrid's last
    W - 1 keys passed again), with a 12-token continuation in the middle (the chunked form from a state, as a
    second chat turn runs): the same outputs as one full forward; the state stays [B, Hkv, D, Dv]."""
    kern = make(name, 4, 2, {"chunk_size": 4, **params})
    n = 26
    q, k, v = inputs(2, 4, 2, n, n, seed=8)
    mask = left_padding(2, n)
    with torch.no_grad():
        full = kern(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
        window = params.get("window", 0)
        outs, state, held = [], None, 0
        for start, end in [(0, 7), *((t, t + 1) for t in range(7, 10)), (10, 22), *((t, t + 1) for t in range(22, n))]:
            first = start - held
            out, state = kern.forward_with_state(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end],
                                                 key_mask=mask[:, first:end], causal=True, scaling=SCALING,
                                                 past=PastKeys(state, first))
            held = min(end, window - 1) if window else 0
            outs.append(out)
            assert state.S.shape == (2, 2, D, DV)
    close(torch.cat(outs, 1), full, mask, n, n, atol=1e-5, rtol=1e-5)
    close(full, brute_force(kern, q, k, v, mask, SCALING), mask, n, n)


@pytest.mark.parametrize("name", NAMES)
def test_packed_rows_reset_the_memory(name):
    """Packed rows (position_ids restarting inside a row) through the attention function transformers calls: each
    document runs from an empty memory, as if alone."""
    from hf_kernel_attn.integration.attention import attention_forward

    kern = make(name, 4, 2, {"chunk_size": 4})
    module = torch.nn.Module()
    module.kernel_attn, module.is_causal = kern, True
    module.eval()
    q, k, v = inputs(1, 4, 2, 13, 13, seed=6)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]])
    out, _ = attention_forward(module, q, k, v, None, scaling=SCALING, position_ids=position_ids)
    for s, e in ((0, 5), (5, 13)):
        want = brute_force(kern, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None, SCALING)
        close(out[:, s:e], want)
    whole = brute_force(kern, q, k, v, None, SCALING)
    assert (out[:, 5:].double() - whole[:, 5:]).abs().max() > 1e-3  # without the reset, another result
    # gradients through the packed row equal the documents' brute force, each alone
    module.train()
    leaf = k.clone().requires_grad_(True)
    out, _ = attention_forward(module, q, leaf, v, None, scaling=SCALING, position_ids=position_ids)
    (got,) = torch.autograd.grad(out.double().sum(), [leaf])
    ref_leaf = k.double().clone().requires_grad_(True)
    ref = torch.cat([brute_force(kern, q[:, :, s:e], ref_leaf[:, :, s:e], v[:, :, s:e], None, SCALING)
                     for s, e in ((0, 5), (5, 13))], 1)
    (want,) = torch.autograd.grad(ref.sum(), [ref_leaf])
    close(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_causal_only(name):
    kern = make(name)
    q, k, v = inputs(1, 4, 2, 5, 5)
    with pytest.raises(ValueError, match="causal only") as err:
        kern(q, k, v, causal=False)
    assert "['deltanet', 'gated_deltanet']" in str(err.value) and "encoder" in str(err.value)
    assert not KERNELS[name].supports_bidirectional and KERNELS[name].supports_causal


@pytest.mark.parametrize("name", NAMES)
def test_registration_and_options(name):
    info = hf_kernel_attn.available_kernels()[name]
    assert KERNELS[name].kind == "delta" and KERNELS[name].is_linear
    assert "Schlag" in KERNELS[name].paper or "Gated Delta" in KERNELS[name].paper
    assert {"feature_map", "beta", "chunk_size", "window", "sinks"} <= set(info["option_info"])
    for bad, words in (({"beta": 1.5}, "beta"), ({"beta": 0}, "beta"), ({"feature_map": "relu"}, "feature_map"),
                       ({"chunk_size": 0}, "chunk_size")):
        with pytest.raises(ValueError, match=words):
            build_kernel(name, LayerShape(4, 2, D), bad)


@pytest.mark.parametrize("name", NAMES)
def test_check_kernel(name):
    from hf_kernel_attn.testing import check_kernel

    errors = check_kernel(name)
    assert any("window=5" in f for f in errors) and any("decoding" in f for f in errors)
    assert not any("bidirectional" in f for f in errors)


@needs_state_cache
@pytest.mark.parametrize("params", [{}, {"window": 4, "sinks": 1}], ids=["plain", "window+sinks"])
@pytest.mark.parametrize("name", NAMES)
def test_tiny_llama_generate_with_cache_equals_full_forward(name, params):
    """A patched tiny Llama: generate() with the recurrent cache (constant-size memory per layer) = greedy decoding
    by full forwards without a cache, token for token and logit for logit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    model = hf_kernel_attn.patch(LlamaForCausalLM(cfg).eval(), kernel=name, chunk_size=4, **params)
    ids = torch.arange(3, 23).view(2, 10) % 128
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True,
              attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        full = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(torch.stack(cached.logits, 1), torch.stack(full.logits, 1), atol=1e-4, rtol=1e-4)
    from hf_kernel_attn.integration.cache import RecurrentStateCache, RecurrentStateLayer

    cache = RecurrentStateCache(model)
    with torch.no_grad():
        model(ids[:1], **cache_arg(cache), use_cache=True)
    layer = cache.layers[0]
    assert isinstance(layer, RecurrentStateLayer) and layer.state.S.shape == (1, 2, 8, 8)


@pytest.mark.parametrize("name", NAMES)
def test_softmax_heads(name):
    """softmax_heads=[h]: those query heads exact softmax over every key, the others the delta rule; decoding from
    the state (which then keeps their K/V) = the full forward."""
    kern = make(name, 4, 2, {"softmax_heads": [1], "chunk_size": 4})
    n = 12
    q, k, v = inputs(2, 4, 2, n, n, seed=12)
    mask = left_padding(2, n)
    with torch.no_grad():
        full = kern(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
        _, state = kern.forward_with_state(q[:, :, :8], k[:, :, :8], v[:, :, :8], key_mask=mask[:, :8],
                                           causal=True, scaling=SCALING)
        outs = []
        for t in range(8, n):
            out, state = kern.forward_with_state(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                 key_mask=mask[:, t:t + 1], causal=True, scaling=SCALING,
                                                 past=PastKeys(state, t))
            outs.append(out)
    close(torch.cat(outs, 1), full[:, 8:])
    want = brute_force(kern, q, k, v, mask, SCALING)
    others = [0, 2, 3]
    close(full[:, :, others], want[:, :, others], mask, n, n)
    logits = SCALING * q[:, 1] @ k[:, 0].transpose(-1, -2)
    logits = logits.masked_fill(~mask[:, None, :] | torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    exact = torch.softmax(logits, -1) @ v[:, 0]
    close(full[:, :, 1], exact, mask, n, n)


@needs_state_cache
@pytest.mark.parametrize("name, n", [("deltanet", 2048), ("gated_deltanet", 512)])
def test_smollm2_decodes_from_the_state_like_one_full_forward(name, n, smollm2, fresh, decodes_like_full_forward):
    """Acceptance: SmolLM2 with the delta rule (window 64 + sinks 4, so both the window and the memory
    matter) greedily decodes 32 tokens after a 2,048-token prompt from its constant-size state; one full forward
    over prompt + generated tokens, with no cache, predicts the same token at every generated position, with
    logits equal to fp32 tolerance. (Gated DeltaNet after 512 tokens, to keep the suite short: its gate is the
    only difference and acts from the first token past the window.)"""
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel=name, window=64, sinks=4)
    decodes_like_full_forward(smollm2, n)
