"""Caches sized by use: a configured sparse cache, sink count or block far larger than the keys seen allocates only
what it holds, and still computes what the float64 brute force says (tests/kernels/sparse_cache_reference.py)."""

from __future__ import annotations

import pytest
import torch

from hf_kernel_attn.kernels import LayerShape, build_kernel
from tests.kernels.sparse_cache_reference import SCALING, brute_force, cached_positions, inputs, make, padding

N = 41


def held_bytes(state) -> int:
    """Bytes of everything a decode state keeps besides the F x Dv state (sinks, cache, pending slots)."""
    parts = [*(state.sparse.tensors() if state.sparse is not None else ()),
             *(state.sinks.tensors() if state.sinks is not None else ())]
    return sum(t.numel() * t.element_size() for t in parts)


def one_key_bytes(kern, batch: int) -> int:
    """What one position costs in the cache of every KV head of a batch: key, value, position and flag."""
    hkv, d = kern.shape.num_kv_heads, kern.shape.head_dim
    return batch * hkv * (d * 8 + 6 * 8 + 8 + 1)


@pytest.mark.parametrize("name", ["hedgehog", "elu"])
def test_a_cache_larger_than_the_context_keeps_every_key_and_costs_only_those(name):
    """C = 20,000 on 41 tokens: every key that left the window is cached (the brute force's set), the outputs are
    the brute force's, and the state holds at most one slot per position seen, not 20,000."""
    kern = make(name, sinks=2, capacity=20_000, block=4)
    q, k, v = inputs(2, 4, 2, N, seed=3)
    mask = padding(2, N, 3)
    got, state = kern.forward_with_state(q, k, v, key_mask=mask, causal=True, scaling=SCALING)
    want, caches = brute_force(kern, q, k, v, mask)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-9, atol=1e-10)
    for (r, h), cache in caches.items():
        assert cached_positions(state, r, h) == cache
    assert state.sparse.keys.shape[-2] <= N and state.sparse.pending_keys.shape[-2] <= 4
    assert held_bytes(state) <= 2 * N * one_key_bytes(kern, 2)


def test_a_large_cache_gives_the_outputs_and_bytes_of_one_that_holds_the_same_keys():
    """Once no more keys left the window than a cache of 40 holds, C = 40 and C = 30,000 keep the same pairs: same
    outputs, same bytes (the large budget allocates nothing more)."""
    q, k, v = inputs(1, 4, 2, N, seed=4)
    results = []
    for capacity in (40, 30_000):
        kern = make(capacity=capacity, block=4)
        out, state = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
        results.append((out, held_bytes(state)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    assert results[0][1] == results[1][1]


def test_sink_slots_grow_with_the_tokens_seen():
    """S = 30,000 sinks: after 41 tokens every real token is a sink (outputs = the brute force's) and 41 slots are
    held, the first decoding steps add one slot each."""
    kern = make(sinks=30_000, capacity=0)
    q, k, v = inputs(1, 4, 2, N, seed=5)
    got, state = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
    want, _ = brute_force(kern, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert state.sinks.keys.shape[-2] == N and bool(state.sinks.valid.all())


def test_a_large_block_holds_no_more_pending_slots_than_keys_left_the_window():
    """B = 30,000: no boundary comes within 41 tokens, so the cache stays empty (the plain hybrid, as the brute
    force says) and the pending ring has one slot per key that left the window."""
    kern = make(capacity=3, block=30_000, sinks=0)
    q, k, v = inputs(1, 4, 2, N, seed=6)
    got, state = kern.forward_with_state(q, k, v, causal=True, scaling=SCALING)
    want, caches = brute_force(kern, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert all(not c for c in caches.values()) and state.sparse.keys.shape[-2] == 0
    window = kern.options.window
    assert state.sparse.pending_keys.shape[-2] == N - window + 1


def test_token_options_are_bounded_by_the_model_and_name_the_range():
    """A count of tokens above max(max_position_embeddings, 32768) is refused when the layer's kernel is built."""
    shape = LayerShape(4, 2, 8, 3, 8192)
    build_kernel("hedgehog", shape, {"window": 8, "sparse_cache": 32768})
    with pytest.raises(ValueError, match=r"layer 3\): sparse_cache=32769 is too large .* ends at 32768"):
        build_kernel("hedgehog", shape, {"window": 8, "sparse_cache": 32769})
    long_model = LayerShape(4, 2, 8, 0, 131072)
    build_kernel("hedgehog", long_model, {"window": 8, "sparse_cache": 100_000})
    with pytest.raises(ValueError, match=r"sinks must be an integer in \[0, 1048576\]"):
        build_kernel("softmax", long_model, {"window": 8, "sinks": 2**21})
    build_kernel("performer", shape, {"num_features": 4096})  # small heads: up to 4096 features all the same
    with pytest.raises(ValueError, match=r"num_features=4097 is too large .* ends at 4096"):
        build_kernel("performer", shape, {"num_features": 4097})
    with pytest.raises(ValueError, match=r"feature_dim=8193 is too large .* ends at 8192"):
        build_kernel("hedgehog", LayerShape(4, 2, 256, 0, 8192), {"feature_dim": 8193})
