"""The bounded sparse cache of the window hybrid (option ``sparse_cache``) against an independent float64 brute force
(tests/kernels/sparse_cache_reference.py: a Python loop that shares only φ with the code under test)."""

from __future__ import annotations

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache, cache_bytes, new_cache
from hf_kernel_attn.kernels import LayerShape, build_kernel
from hf_kernel_attn.kernels.linear import PastKeys
from tests.compat import needs_state_cache
from tests.kernels.sparse_cache_reference import (
    SCALING,
    D,
    brute_force,
    cached_positions,
    f64,
    inputs,
    make,
    padding,
    tiny_lm,
)


@pytest.mark.parametrize("name", ["hedgehog", "elu"])
@pytest.mark.parametrize("sinks, pad, capacity, block, heads", [(0, 0, 3, 4, ()), (2, 3, 2, 5, ()), (0, 4, 4, 3, ()),
                                                                (2, 3, 3, 4, (1, 2))])
def test_outputs_and_cache_match_brute_force(name, sinks, pad, capacity, block, heads):
    """Outputs and cached pairs; with ``softmax_heads`` those heads are retrieval heads on a budget (softmax over
    the sinks, the window and the cache of their KV head, nothing else)."""
    kern = make(name, sinks=sinks, capacity=capacity, block=block, heads=heads)
    q, k, v = inputs(2, 4, 2, 41)
    mask = padding(2, 41, pad) if pad else None
    got, state = kern.forward_with_state(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    want, caches = brute_force(kern, q, k, v, mask)
    rows = torch.ones(2, 41, dtype=torch.bool) if mask is None else mask
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-9, atol=1e-10)
    for (r, h), cache in caches.items():
        assert cached_positions(state, r, h) == cache
    assert all(len(c) == capacity for c in caches.values())  # enough keys left the window to fill it
    # the cache changes what comes out: without it the same kernel gives other outputs
    plain = build_kernel(name, kern.shape, {**vars(kern.options), "sparse_cache": 0}).to(f64)
    plain.load_state_dict(kern.state_dict())
    assert not torch.allclose(plain(q, k, v, key_mask=mask, causal=True, scaling=SCALING)[rows], got[rows])


def _stream(kern, q, k, v, mask, pieces):
    """Feed the sequence in pieces as the recurrent cache layer does (the last W - 1 keys kept beside the state)."""
    state, wk, wv, pos, outs = None, None, None, 0, []
    window = kern.options.window
    for length in pieces:
        kk, vv = k[:, :, pos:pos + length], v[:, :, pos:pos + length]
        if wk is not None:
            kk, vv = torch.cat([wk, kk], 2), torch.cat([wv, vv], 2)
        off = pos + length - kk.shape[2]
        out, state = kern.forward_with_state(q[:, :, pos:pos + length], kk, vv, key_mask=mask[:, off:pos + length],
                                             causal=True, scaling=SCALING, past=PastKeys(state, off))
        keep = min(kk.shape[2], window - 1)
        wk, wv = kk[:, :, kk.shape[2] - keep:], vv[:, :, kk.shape[2] - keep:]
        outs.append(out)
        pos += length
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("pieces", [[1] * 45, [13, 1, 1, 1, 7, 22], [4, 4, 37], [44, 1]])
def test_prefill_and_decoding_keep_the_same_pairs(pieces):
    """Chunked prefill and token-by-token decoding (the state carried, the last W - 1 keys passed again) give the
    outputs and the cached pairs of one forward over the whole sequence."""
    kern = make(sinks=2, capacity=3, block=4)
    q, k, v = inputs(2, 4, 2, 45, seed=1)
    mask = padding(2, 45, 3)
    full, state = kern.forward_with_state(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    stepped, stream_state = _stream(kern, q, k, v, mask, pieces)
    torch.testing.assert_close(stepped[mask], full[mask], rtol=1e-9, atol=1e-10)
    for r in range(2):
        for h in range(2):
            assert cached_positions(stream_state, r, h) == cached_positions(state, r, h)
    torch.testing.assert_close(stream_state.S, state.S, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("pieces", [[45], [1] * 45])
def test_float32_keeps_the_pairs_of_the_float64_reference(pieces):
    """In float32 a prefill and token-by-token decoding keep the pairs that the float64 brute force keeps, and
    the outputs agree to float32 rounding: no score is the rounding noise of a state minus its candidates divided
    by a small z'·φ(k) (the state left alone once held the candidates and took them out again)."""
    f32 = torch.float32
    kern = make(sinks=2, capacity=3, block=4, dtype=f32)
    q, k, v = inputs(2, 4, 2, 45, seed=1, dtype=f32)
    mask = padding(2, 45, 3)
    got, state = _stream(kern, q, k, v, mask, pieces)
    want, caches = brute_force(kern, q, k, v, mask)
    torch.testing.assert_close(got[mask].to(f64), want[mask], rtol=1e-4, atol=1e-5)
    for (r, h), cache in caches.items():
        assert cached_positions(state, r, h) == cache


def test_the_cache_at_p_depends_only_on_the_prompt_up_to_p():
    """Question-agnostic: two prompts identical up to position p and different after it hold the same cache at p
    (and give the same outputs before it), whichever way they are fed."""
    kern = make(capacity=3, block=4)
    q, k, v = inputs(1, 4, 2, 48, seed=2)
    q2, k2, v2 = inputs(1, 4, 2, 48, seed=9)
    p = 29
    q2[:, :, :p], k2[:, :, :p], v2[:, :, :p] = q[:, :, :p], k[:, :, :p], v[:, :, :p]
    mask = torch.ones(1, 48, dtype=torch.bool)
    _, a = _stream(kern, q, k, v, mask, [p, 48 - p])
    _, b = _stream(kern, q2, k2, v2, mask, [5, p - 5, 48 - p])
    out_a = kern(q, k, v, causal=True, scaling=SCALING)
    out_b = kern(q2, k2, v2, causal=True, scaling=SCALING)
    torch.testing.assert_close(out_a[:, :p], out_b[:, :p], rtol=0, atol=1e-12)
    assert not torch.allclose(out_a[:, p:], out_b[:, p:])
    _, a_at_p = _stream(kern, q, k, v, mask, [p])
    _, b_at_p = _stream(kern, q2, k2, v2, mask, [3, 1, p - 4])
    for h in range(2):
        assert cached_positions(a_at_p, 0, h) == cached_positions(b_at_p, 0, h)
        assert cached_positions(a, 0, h) != set() and cached_positions(b, 0, h) != set()


def test_bad_options_name_the_problem():
    with pytest.raises(ValueError, match="sparse_cache=4 needs a window"):
        build_kernel("hedgehog", LayerShape(4, 2, D, 0, 4096), {"sparse_cache": 4})
    with pytest.raises(ValueError, match="not supported by this kernel.*hedgehog"):
        build_kernel("gla", LayerShape(4, 2, D, 0, 4096), {"window": 8, "sparse_cache": 4})
    with pytest.raises(ValueError, match=r"sparse_block must be an integer in \[1, "):
        build_kernel("hedgehog", LayerShape(4, 2, D, 0, 4096), {"window": 8, "sparse_cache": 4, "sparse_block": 0})
    kern = make()
    q, k, v = inputs(1, 4, 2, 12)
    with pytest.raises(ValueError, match="causal only"):
        kern(q, k, v, causal=False, scaling=SCALING)


@needs_state_cache
def test_cache_bytes_do_not_grow_with_the_context():
    """The decode cache after prompts of 96, 160 and 320 tokens holds the same bytes (fixed slots)."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=8, sinks=2, sparse_cache=6, sparse_block=4)
    sizes = []
    for n in (96, 160, 320):
        cache = RecurrentStateCache(model)
        with torch.no_grad():
            model(torch.randint(1, 97, (1, n), generator=torch.Generator().manual_seed(n)), past_key_values=cache,
                  use_cache=True)
        sizes.append(cache_bytes(cache))
    assert sizes[0] == sizes[1] == sizes[2] > 0


@needs_state_cache
@pytest.mark.parametrize("capacity, block, sinks", [(4, 3, 2), (20_000, 3, 2), (4, 30_000, 2), (4, 3, 30_000)])
def test_cached_generation_equals_recomputation_with_left_padding(capacity, block, sinks):
    """Also with a cache, a block or sinks far larger than the 60 tokens (slots grown with use while decoding)."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=sinks, window_mix=True, sparse_cache=capacity,
                         sparse_block=block)
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, **kw)
        full = model.generate(ids, attention_mask=mask, use_cache=False, **kw)
    assert isinstance(cached.past_key_values, RecurrentStateCache)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(full.logits), rtol=1e-4, atol=1e-4)


@needs_state_cache
@pytest.mark.slow(30)
def test_smollm2_decodes_with_its_sparse_cache_like_one_full_forward(smollm2, fresh, decodes_like_full_forward):
    """Acceptance: SmolLM2 with hedgehog, window 64 + 4 sinks + a 32-pair sparse cache greedily decodes
    32 tokens after a 2,048-token prompt; one full forward over prompt + generated tokens, with no cache, predicts
    the same token at every generated position, with logits equal to fp32 tolerance."""
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel="hedgehog", window=64, sinks=4, sparse_cache=32)
    decodes_like_full_forward(smollm2, 2048)


def test_a_saved_model_takes_a_sparse_cache_at_load(tmp_path):
    """``from_pretrained(path, kernel_params=...)`` without a kernel adds the options to the saved kernel (every layer
    that runs it; a softmax layer stays softmax): the loaded model equals one patched with all options at once."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, window_mix=True, layers={0: "softmax"})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("window_log_mix"):
                p.normal_()
    model.save_pretrained(tmp_path)
    loaded = hf_kernel_attn.from_pretrained(tmp_path, kernel_params={"sparse_cache": 4, "sparse_block": 3}).eval()
    cfg = hf_kernel_attn.kernel_config(loaded)
    assert cfg.kernel == "hedgehog" and cfg.params == {"window": 6, "sinks": 2, "window_mix": True, "sparse_cache": 4,
                                                      "sparse_block": 3}
    assert cfg.for_layer(0).kernel == "softmax" and cfg.for_layer(0).params == {}
    hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, window_mix=True, sparse_cache=4, sparse_block=3,
                         layers={0: "softmax"})
    model.load_state_dict(loaded.state_dict())
    ids = torch.randint(1, 97, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
        plain = hf_kernel_attn.from_pretrained(tmp_path).eval()(ids).logits
    assert not torch.allclose(plain, model(ids).logits)
    with pytest.raises(ValueError, match="sparse_cach"):
        hf_kernel_attn.from_pretrained(tmp_path, kernel_params={"sparse_cach": 4})


def test_gradients_through_the_cache_match_finite_differences():
    """Training with the cache on: the selection is piecewise constant, the outputs differentiable through q, k, v and
    the kernel's parameters (autograd against central differences in float64)."""
    kern = make(sinks=1, capacity=2, block=3)
    q, k, v = inputs(1, 4, 2, 19, seed=4)
    params = [p for p in kern.parameters() if p.requires_grad]

    def run(*tensors):
        return kern(*tensors, causal=True, scaling=SCALING)

    assert torch.autograd.gradcheck(run, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), eps=1e-6,
                                    atol=1e-6, fast_mode=True)
    out = run(q, k, v).square().sum()
    grads = torch.autograd.grad(out, params)
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and grads[0].abs().sum() > 0


def test_budgeted_retrieval_heads_hold_no_growing_kv():
    """softmax_heads with a sparse cache keep no K/V of their own: the state after 90 keys and after 300 holds the
    same bytes, and decoding equals one forward."""
    kern = make(heads=(0, 3), sinks=2, capacity=3, block=4)
    sizes = []
    for n in (90, 300):
        q, k, v = inputs(1, 4, 2, n, seed=n)
        mask = torch.ones(1, n, dtype=torch.bool)
        full, state = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
        assert state.exact is None
        sizes.append(sum(t.numel() * t.element_size() for t in (state.S, state.z, *state.sparse.tensors(),
                                                                  *state.sinks.tensors())))
        stepped, _ = _stream(kern, q, k, v, mask, [n - 7] + [1] * 7)
        torch.testing.assert_close(stepped, full, rtol=1e-9, atol=1e-10)
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("name", ["hedgehog", "elu"])
def test_plain_hybrid_decode_steps_equal_one_forward(name):
    """Without a sparse cache too: token-by-token steps (the one-query form of the hybrid) with sinks, left padding
    and GQA give the outputs and the state of one forward over the whole sequence, in float64."""
    kern = make(name, sinks=2, capacity=0)
    q, k, v = inputs(2, 4, 2, 30, seed=5)
    mask = padding(2, 30, 4)
    full, state = kern.forward_with_state(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    stepped, stream_state = _stream(kern, q, k, v, mask, [3] + [1] * 27)
    torch.testing.assert_close(stepped[mask], full[mask], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stream_state.S, state.S, rtol=1e-10, atol=1e-12)


@needs_state_cache
def test_bf16_autocast_runs_the_cache_close_to_float32():
    """`torch.autocast("cpu", torch.bfloat16)` around a sparse-cache model (the scores and the state stay float32
    inside the kernel): a prefill's logits stay within bf16 rounding of the float32 model's, and token-by-token
    decoding under autocast keeps the pairs of one autocast forward over the same tokens."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, window_mix=True, sparse_cache=4,
                         sparse_block=3)
    ids = torch.randint(1, 97, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(ids).logits
            full = new_cache(model)
            model(ids, past_key_values=full, use_cache=True)
            steps = new_cache(model)
            for t in range(ids.shape[1]):
                model(ids[:, t:t + 1], past_key_values=steps, use_cache=True)
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got).all())
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 0.05, f"bf16 autocast logits differ from float32 by {err:.3f} of their scale"
    for layer in range(2):
        a, b = full.layers[layer].state, steps.layers[layer].state
        for h in range(2):
            assert cached_positions(a, 0, h) == cached_positions(b, 0, h)
