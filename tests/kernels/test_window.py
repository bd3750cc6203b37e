"""Sliding-window hybrid kernels (option ``window``): every feature-map kernel against the float64 brute force
of tests/kernels/reference.py (exp(s q·k) inside the window, the kernel's own weight outside, one normaliser), the two
limits (W ≥ N is softmax, W = 0 is the plain kernel), gradients, the decoding state and the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache, RecurrentStateLayer
from hf_kernel_attn.kernels import KERNELS, LayerShape, build_kernel
from hf_kernel_attn.kernels.linear import PastKeys, cost
from tests.compat import cache_arg, needs_state_cache
from tests.kernels import reference as ref
from tests.kernels.window_helpers import DV, SCALING, D, assert_gradients_match, compare, inputs, make, padding  # noqa: F401

FEATURE_MAPS = sorted(n for n, c in KERNELS.items() if c.is_linear)


@pytest.mark.parametrize("name", FEATURE_MAPS)
@pytest.mark.parametrize("window_size", [1, 7, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_against_brute_force(name, window_size, causal, monkeypatch):
    """GQA 4/2, with and without key padding, N = M and N < M, Dv = D and Dv ≠ D; several chunks, and
    (no grad) several blocks of chunks."""
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")
    monkeypatch.setattr(cost, "BAND_SCORE_VALUES", 4096)  # blocks of one or two chunks
    kern = make(name, window_size)
    for n, m, dv in [(150, 150, D), (9, 90, DV), (70, 70, DV)]:
        q, k, v = inputs(2, 4, 2, n, m, dv=dv)
        compare(kern, q, k, v, padding(2, m, causal), causal, 1e-10)
        compare(kern, q, k, v, None, causal, 1e-10)
    # fp32 inputs: the acceptance tolerance
    kern32 = make(name, window_size, dtype=torch.float32)
    q, k, v = inputs(2, 4, 2, 130, 130, dtype=torch.float32, seed=1, dv=D)
    compare(kern32, q, k, v, padding(2, 130, causal), causal, 1e-4)
    compare(kern32, q, k, v, None, causal, 1e-4)


@pytest.mark.parametrize("name", FEATURE_MAPS)
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_brute_force(name, causal):
    if not causal and not KERNELS[name].supports_bidirectional:
        pytest.skip("causal only")
    kern = make(name, 7)
    q, k, v = (t.requires_grad_() for t in inputs(2, 4, 2, 40, 40, seed=2))
    mask = padding(2, 40, causal)
    rows = ref.real_queries(2, 40, 40, causal, mask)
    gout = torch.randn(2, 40, 4, DV, dtype=torch.float64) * rows[:, :, None, None]
    params = [p for p in kern.parameters() if p.requires_grad]
    mix = kern.memory_mix if hasattr(kern, "memory_mix") else kern.window_log_mix
    assert any(p is mix for p in params)
    got = torch.autograd.grad((kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING) * gout).sum(),
                              [q, k, v, *params])
    want = torch.autograd.grad((ref.reference(kern, q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
                                * gout).sum(), [q, k, v, *params])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_window_covering_the_sequence_is_softmax(name):
    """W ≥ N: every key is in the window, so the hybrid is exactly softmax(s q·k) (λ plays no part)."""
    for causal in (True, False) if KERNELS[name].supports_bidirectional else (True,):
        kern = make(name, 64)
        q, k, v = inputs(2, 4, 2, 40, 40, seed=3)
        mask = padding(2, 40, causal)
        out = kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
        want = ref.softmax_ref(None, q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
        rows = ref.real_queries(2, 40, 40, causal, mask)
        assert (out - want).abs()[rows].max().item() <= 1e-12


@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_window_zero_is_the_plain_kernel(name):
    """window=0 given explicitly runs the kernel without a window option at all (the brute force of the plain
    kernel), and sinks=0 alongside it changes nothing."""
    plain = build_kernel(name, LayerShape(4, 2, D, 1, 4096), {"chunk_size": 16}).double()
    explicit = build_kernel(name, LayerShape(4, 2, D, 1, 4096), {"window": 0, "sinks": 0, "chunk_size": 16}).double()
    assert "window" not in type(plain.options).__dataclass_fields__ or plain.options.window == 0
    explicit.load_state_dict(plain.state_dict())
    q, k, v = inputs(2, 4, 2, 50, 50, seed=4)
    for causal in (True, False) if plain.supports_bidirectional else (True,):
        want = ref.reference(plain, q, k, v, causal=causal, scaling=SCALING)
        out = explicit(q, k, v, causal=causal, scaling=SCALING)
        assert (out - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize("name", ["elu", "cosformer", "dijiang", "hedgehog"])
@pytest.mark.parametrize("window_size", [1, 5, 20])
def test_decoding_state_and_window_equal_recomputation(name, window_size):
    """Feeding the sequence in pieces — the kept last W - 1 keys first, the state of every older key — gives
    the outputs of one pass (positions and the DiJiang decay included)."""
    kern = make(name, window_size, chunk_size=8)
    q, k, v = inputs(1, 4, 2, 37, 37, seed=5)
    full = kern(q, k, v, causal=True)
    state, keys, values, pos, outs = None, k[:, :, :0], v[:, :, :0], 0, []
    for piece in (10, 1, 1, 7, 1, 1, 1, 15):
        ks = torch.cat([keys, k[:, :, pos:pos + piece]], 2)
        vs = torch.cat([values, v[:, :, pos:pos + piece]], 2)
        out, state = kern.forward_with_state(q[:, :, pos:pos + piece], ks, vs, causal=True,
                                             past=PastKeys(state, pos - keys.shape[2]))
        keep = min(ks.shape[2], window_size - 1)
        keys, values = ks[:, :, ks.shape[2] - keep:], vs[:, :, vs.shape[2] - keep:]
        outs.append(out)
        pos += piece
    assert (torch.cat(outs, 1) - full).abs().max().item() <= 1e-12


def tiny_llama(kernel="hedgehog", **params):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    hf_kernel_attn.patch(model, kernel=kernel, **params)
    return model


@pytest.mark.parametrize("kernel", ["hedgehog", "dijiang"])
def test_cached_generation_equals_recomputation_with_left_padding(kernel):
    model = tiny_llama(kernel, window=6, window_mix=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kernel_attn.window_log_mix.normal_()
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=15, min_new_tokens=15, do_sample=False, return_dict_in_generate=True, output_logits=True)
    cached = model.generate(ids, attention_mask=mask, **kw)
    full = model.generate(ids, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(cached.sequences, full.sequences)
    assert (torch.stack(cached.logits) - torch.stack(full.logits)).abs().max().item() <= 1e-4


@needs_state_cache
def test_cache_memory_is_constant_in_the_context():
    model = tiny_llama("hedgehog", window=16)
    ids = torch.randint(1, 97, (1, 5))
    sizes = {}
    for n in (128, 1024):
        cache = RecurrentStateCache(model)
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache_arg(cache))
        assert all(isinstance(layer, RecurrentStateLayer) and layer.window_keys.shape[-2] == 15
                   for layer in cache.layers)
        sizes[n] = cache.nbytes()
    assert sizes[128] == sizes[1024] > 0


@pytest.mark.parametrize("bad, message", [
    ({"window": -1}, r"window must be an integer in \[0, "),
    ({"window": 2.5}, r"window must be an integer in \[0, "),
    ({"window": True}, r"window must be an integer in \[0, "),
    ({"window_mix": True}, "window_mix=True needs a window > 0"),
    ({"window": 4, "window_mix": "yes"}, "window_mix must be one of"),
])
def test_bad_window_options(bad, message):
    with pytest.raises(ValueError, match=message):
        build_kernel("hedgehog", LayerShape(4, 2, D), bad)


@pytest.mark.real_model
def test_smollm2_window_covering_the_text_equals_softmax(smollm2, smollm2_tok, fresh):
    """Acceptance: with W ≥ N the hybrid gives SmolLM2's softmax logits (≤ 1e-4)."""
    fresh(smollm2)
    ids = smollm2_tok(["The tower is 324 metres tall, about the same height as an 81-storey building, and the "
                       "tallest structure in Paris."], return_tensors="pt").input_ids
    with torch.no_grad():
        hf_kernel_attn.unpatch(smollm2)
        want = smollm2(ids).logits
        hf_kernel_attn.patch(smollm2, kernel="hedgehog", window=ids.shape[1])
        got = smollm2(ids).logits
    assert (got - want).abs().max().item() <= 1e-4


@needs_state_cache
@pytest.mark.real_model
def test_smollm2_hedgehog_window64_generation_and_constant_cache(smollm2, smollm2_tok, fresh):
    """Acceptance: cached greedy generation with hedgehog + window 64 equals recomputation (a prompt longer
    than the window), and the cache holds as many bytes after 1,024 tokens as after 128."""
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel="hedgehog", window=64)
    text = ("In 1889 the tower was the entrance arch to the World's Fair. It was criticised by some of France's "
            "leading artists and intellectuals for its design, but it has become a global cultural icon of France "
            "and one of the most recognisable structures in the world. The tower received 5,889,000 visitors in "
            "2022. It is the most visited monument with an entrance fee in the world.")
    batch = smollm2_tok([text], return_tensors="pt")
    assert batch.input_ids.shape[1] > 64
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    cached = smollm2.generate(**batch, **kw)
    full = smollm2.generate(**batch, use_cache=False, **kw)
    assert torch.equal(cached, full)
    sizes = {}
    long_ids = torch.randint(100, 40000, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for n in (128, 1024):
            cache = RecurrentStateCache(smollm2)
            smollm2(long_ids[:, :n], **cache_arg(cache), use_cache=True)
            sizes[n] = cache.nbytes()
    assert sizes[128] == sizes[1024] > 0


def test_window_speed_benchmark_rows_and_errors():
    from hf_kernel_attn.speed.window_bench import HeadShape, window_speed

    rows = window_speed(["elu"], length=96, window=8, rounds=2, shape=HeadShape(heads=4, kv_heads=2, head_dim=8),
                        threads=1)
    assert [(r["kernel"], r["window"]) for r in rows] == [("softmax", 0), ("elu", 0), ("elu", 8)]
    assert rows[0]["ratio_vs_sdpa"] == 1.0 and all(len(r["round_ratios"]) == 2 for r in rows)
    assert all(r["time_s"] > 0 and r["speedup_vs_sdpa"] == pytest.approx(1 / r["ratio_vs_sdpa"]) for r in rows)
    with pytest.raises(ValueError, match="feature-map kernels"):
        window_speed(["gaussian"], length=32)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        window_speed(["elu"], length=32, window=0)


def test_hybrid_of_softmax_and_windowed_layers_generates_like_recomputation():
    """A softmax layer (DynamicLayer K/V) next to a windowed one (state + window) in one cache."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    hf_kernel_attn.patch(model, kernel="elu", layers={0: "softmax"}, window=5)
    cache = RecurrentStateCache(model)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicLayer", "RecurrentStateLayer"]
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    cached = model.generate(ids, attention_mask=mask, **kw)
    full = model.generate(ids, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(cached, full)
