"""The window hybrid's packed decode step (``kernels/linear/window_decode.py``), with and without a sparse cache,
against the float64 brute force of ``test_sparse_cache`` (a Python loop that shares only φ with the code under test),
and through the cache layer: generation with the packed step equals recomputation without a cache, in greedy and
beam search, and the packed layout holds the bytes of the general one."""

from __future__ import annotations

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache, RecurrentStateLayer, cache_bytes
from tests.compat import needs_state_cache
from tests.kernels.sparse_cache_reference import SCALING, D, brute_force, cached_positions, inputs, make, tiny_lm


@torch.no_grad()  # the packed step is for inference: under autograd the general form runs
def _prefill_then_packed_steps(kern, q, k, v, prefill):
    """The general forward over the first ``prefill`` tokens, then the packed step for every later token."""
    window = kern.options.window
    out, state = kern.forward_with_state(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], causal=True,
                                         scaling=SCALING)
    ring = window - 1
    wk = k[:, :, prefill - ring:prefill] if ring else None
    wv = v[:, :, prefill - ring:prefill] if ring else None
    assert kern.can_pack(state, wk, prefill)
    packed = kern.pack_decode_state(state, wk, wv, prefill, SCALING)
    outs = [out]
    for t in range(prefill, q.shape[2]):
        qt, kt, vt = q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]
        assert kern.fits_packed(packed, qt, kt, vt, None)
        outs.append(kern.decode_packed(qt, kt, vt, packed, SCALING))
    return torch.cat(outs, 1), packed


@pytest.mark.parametrize("name, window, sinks, heads, capacity", [
    *((name, *case) for name in ("hedgehog", "elu") for case in [
        (5, 2, (), 3), (5, 0, (1, 2), 3), (4, 2, (0, 1, 2, 3), 3), (1, 1, (), 3), (5, 2, (), 0), (6, 0, (), 0)]),
    ("cosformer", 5, 2, (), 0),  # φ depends on the position: the packed step passes each one
])
def test_packed_steps_match_the_brute_force(name, window, sinks, heads, capacity):
    """Outputs of the packed steps (boundaries every 4 positions, GQA, λ per head; some or all heads retrieval heads
    on a budget; a window of one key; no cache: the plain hybrid) and the pairs cached at the end, against the brute
    force; unpacking gives the general form's state after one forward over the whole sequence."""
    kern = make(name, window=window, sinks=sinks, capacity=capacity, block=4, heads=heads)
    q, k, v = inputs(2, 4, 2, 47, seed=6)
    got, packed = _prefill_then_packed_steps(kern, q, k, v, 21)
    want, caches = brute_force(kern, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    state, wk, _ = hf_kernel_attn.kernels.linear.window_decode.unpack(packed)
    _, full = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
    if capacity:
        for (r, h), cache in caches.items():
            assert cached_positions(state, r, h) == cache
        assert torch.equal(state.sparse.pending_ok, full.sparse.pending_ok)
    else:
        assert state.sparse is None and full.sparse is None
    torch.testing.assert_close(state.S, full.S, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state.z, full.z, rtol=1e-9, atol=1e-10)
    if window > 1:
        assert torch.equal(wk, k[:, :, 47 - (window - 1):])
    if sinks:
        assert torch.equal(state.sinks.real_seen, full.sinks.real_seen) and state.sinks.seen == full.sinks.seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_steps_with_equal_head_sizes_match_the_brute_force(dtype):
    """Values as wide as keys (D = Dv, as in every model): the hybrid's softmax part then comes from the fused CPU
    attention kernel with its log-sum-exp; in float64 and float32 against the float64 brute force."""
    kern = make(window=5, sinks=2, capacity=3, block=4, heads=(1,), dtype=dtype)
    q, k, v = inputs(2, 4, 2, 47, seed=8, dtype=dtype, dv=D)
    got, _ = _prefill_then_packed_steps(kern, q, k, v, 21)
    want, _ = brute_force(kern, q, k, v)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.to(torch.float64), want, **tol)


def test_a_state_is_not_packed_before_its_cache_is_full_or_while_a_sink_can_enter_the_window():
    """Nor for kernels the packed step cannot serve: exact heads that keep every key, a decay, a state of the
    kernel's own (the delta rule)."""
    assert not make(window=5, capacity=0, heads=(1,)).decodes_packed
    assert not make("gla", window=5, capacity=0, mix=False).decodes_packed
    assert not make("deltanet", window=5, capacity=0, mix=False).decodes_packed
    assert make(window=5, capacity=0).decodes_packed
    kern = make(window=5, sinks=2, capacity=3, block=4)
    q, k, v = inputs(1, 4, 2, 30, seed=7)
    _, state = kern.forward_with_state(q[:, :, :8], k[:, :, :8], v[:, :, :8], causal=True, scaling=SCALING)
    assert not kern.can_pack(state, k[:, :, 4:8], 8)  # 3 keys have left the window: the cache is not full
    _, state = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
    assert kern.can_pack(state, k[:, :, 26:], 30)
    assert not kern.can_pack(state, k[:, :, 27:], 30)  # the window's keys are not all there


def _packed_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, RecurrentStateLayer)]


@needs_state_cache
@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("capacity", [4, 0])
def test_generation_with_packed_steps_equals_recomputation(beams, capacity):
    """A tiny Llama with the window hybrid (with a sparse cache: one layer hybrid, one of budgeted retrieval heads;
    without: the plain sinks + window hybrid) generates 24 tokens after a 40-token prompt with the packed step (beam
    search reorders it) and without any cache: the same tokens and logits."""
    model = tiny_lm()
    if capacity:
        budgeted = {"window": 6, "sinks": 2, "sparse_cache": capacity, "sparse_block": 3, "softmax_heads": [0, 1, 2, 3]}
        hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, window_mix=True, sparse_cache=capacity,
                             sparse_block=3, layers={1: {"kernel": "hedgehog", "params": budgeted}})
    else:
        hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, window_mix=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("window_log_mix"):
                p.normal_()
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, num_beams=beams, return_dict_in_generate=True,
              output_logits=True)
    with torch.no_grad():
        cached = model.generate(ids, **kw)
        full = model.generate(ids, use_cache=False, **kw)
    layers = _packed_layers(cached.past_key_values)
    assert len(layers) == 2 and all(layer.is_packed for layer in layers)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(full.logits), rtol=1e-4, atol=1e-4)


@needs_state_cache
def test_packed_layout_holds_the_bytes_of_the_general_one_and_a_longer_chunk_continues_it():
    """After packed steps the cache holds as many bytes as once unpacked (reading ``state`` unpacks); a 5-token
    chunk after them (the general form again) gives the logits of one forward over every token."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, sparse_cache=4, sparse_block=3)
    ids = torch.randint(1, 97, (1, 60), generator=torch.Generator().manual_seed(5))
    cache = RecurrentStateCache(model)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, 55):
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        assert all(layer.is_packed for layer in _packed_layers(cache))
        packed_bytes = cache_bytes(cache)
        assert all(layer.state is not None and not layer.is_packed for layer in _packed_layers(cache))
        assert cache_bytes(cache) == packed_bytes
        for t in range(55, 57):  # packed again by the next general call, then stepped
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        assert all(layer.is_packed for layer in _packed_layers(cache))
        tail = model(ids[:, 57:], past_key_values=cache, use_cache=True).logits
        want = model(ids, use_cache=False).logits[:, 57:]
    torch.testing.assert_close(tail, want, rtol=1e-4, atol=1e-4)


@needs_state_cache
def test_a_padded_token_after_packed_steps_takes_the_general_form():
    """A decode step whose new token is padding in one row leaves the packed layout (the general form masks it);
    the next real token's logits equal one forward over every token with the same padding mask."""
    model = tiny_lm()
    hf_kernel_attn.patch(model, kernel="hedgehog", window=6, sinks=2, sparse_cache=4, sparse_block=3)
    ids = torch.randint(1, 97, (2, 52), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 52, dtype=torch.long)
    mask[1, 49] = 0
    cache = RecurrentStateCache(model)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, 52):
            logits = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                           use_cache=True).logits
            assert all(layer.is_packed for layer in _packed_layers(cache)) == (t < 49)
        want = model(ids, attention_mask=mask, use_cache=False).logits[:, -1:]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_a_changed_mix_reaches_the_next_packed_step():
    """λ is worked out once and kept while ``window_log_mix`` is unchanged; an in-place change (an optimizer step,
    ``load_state_dict``) reaches the next packed step: its output equals the brute force with the new λ."""
    kern = make(window=5, sinks=2, capacity=3, block=4, heads=(2,))  # λ = 0 in head 2: λ is a new tensor
    q, k, v = inputs(1, 4, 2, 24, seed=9)
    _, packed = _prefill_then_packed_steps(kern, q[:, :, :23], k[:, :, :23], v[:, :, :23], 21)
    with torch.no_grad():
        kern.window_log_mix.add_(torch.tensor([0.7, -0.4, 0.2, 1.1], dtype=kern.window_log_mix.dtype))
        got = kern.decode_packed(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], packed, SCALING)
    want, _ = brute_force(kern, q, k, v)
    torch.testing.assert_close(got[:, 0], want[:, 23], rtol=1e-9, atol=1e-10)
