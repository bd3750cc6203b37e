"""``check_kernel`` with sinks and a sparse cache: its brute force (``hf_kernel_attn.testing.sparse_reference``) is
the definition of the window hybrid with sinks and the bounded sparse cache; built-in kernels pass it in every
causal form (bidirectional calls are refused), kernels that get the cache or the sinks wrong fail it, and the
reference reduces to exact softmax where every key is a sink or a cached pair."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

import hf_kernel_attn
from hf_kernel_attn.kernels import LayerShape, build_kernel
from hf_kernel_attn.testing import check_kernel
from hf_kernel_attn.testing.sparse_reference import HybridRule, cache_history, hybrid_reference

KIT = {"window": 5, "sinks": 2, "sparse_cache": 3, "sparse_block": 4}
TAG = "window=5 sinks=2 sparse_cache=3 sparse_block=4"


class Softplus(hf_kernel_attn.FeatureMapKernel):
    name = "softplus-features"

    def feature_map(self, x):
        return F.softplus(x)


class LateBoundaries(Softplus):
    """Chooses its cache every B + 1 positions instead of every B."""

    name = "late-boundaries"

    def hybrid_spec(self, scaling):
        return dataclasses.replace(super().hybrid_spec(scaling), block=self.options.sparse_block + 1)


class OnePairLess(Softplus):
    """Keeps C - 1 pairs in its cache."""

    name = "one-pair-less"

    def hybrid_spec(self, scaling):
        return dataclasses.replace(super().hybrid_spec(scaling), capacity=self.options.sparse_cache - 1)


class OneSinkLess(Softplus):
    """Runs with S - 1 sinks while its options say S."""

    name = "one-sink-less"

    def forward_with_state(self, q, k, v, **kw):
        told = self.options
        self.options = dataclasses.replace(told, sinks=max(0, told.sinks - 1))
        try:
            return super().forward_with_state(q, k, v, **kw)
        finally:
            self.options = told


class SequenceMean(Softplus):
    """φ mixes in the mean over the keys of the call: the cache's φ of its pool differs from the sequence's."""

    name = "sequence-mean"

    def feature_map(self, x):
        return F.softplus(x + 0.5 * x.mean(-2, keepdim=True))


class AcceptsBidirectional(Softplus):
    """Answers a bidirectional call without its cache instead of refusing it."""

    name = "accepts-bidirectional"

    def forward_with_state(self, q, k, v, *, causal=True, **kw):
        told = self.options
        if not causal:
            self.options = dataclasses.replace(told, sparse_cache=0)
        try:
            return super().forward_with_state(q, k, v, causal=causal, **kw)
        finally:
            self.options = told


@pytest.mark.parametrize("name", ["hedgehog", "elu", "taylor"])
def test_builtins_pass_with_sinks_and_a_sparse_cache(name):
    """Every causal form with window 5, 2 sinks and 3 pairs chosen every 4 positions, the refusal of bidirectional
    calls, decoding in pieces from the state and on the packed layout."""
    errors = check_kernel(name, KIT)
    for start in (f"causal {TAG} Hq=4", f"causal {TAG} Hq=3", f"gradients causal {TAG}", f"decoding {TAG}",
                  f"bidirectional {TAG}", f"bfloat16 autocast causal {TAG}"):
        assert any(f.startswith(start) for f in errors), start
    assert any("refused" in f for f in errors) and any("packed steps" in f for f in errors)
    assert not any(f.startswith("bidirectional") and "refused" not in f for f in errors)


def test_sinks_with_a_decay_and_exact_heads():
    """gla (a gated state) with sinks; hedgehog with a budgeted exact head and with an exact head over every key."""
    assert any(f.startswith("decoding window=5 sinks=2") for f in check_kernel("gla", {"window": 5, "sinks": 2}))
    check_kernel("hedgehog", {**KIT, "softmax_heads": [1]})
    check_kernel("hedgehog", {"window": 5, "sinks": 2, "softmax_heads": [1]})


def test_long_hybrid_options_are_also_checked_at_kit_size():
    """Defaults a 17-token sequence would not reach (W = 64, S = 4, C = 16) are checked as they are and at kit
    size."""
    errors = check_kernel(Softplus, {"window": 64, "sinks": 4, "sparse_cache": 16})
    assert any(f.startswith("causal window=64 sinks=4 sparse_cache=16 sparse_block=16") for f in errors)
    assert any(f.startswith(f"causal {TAG}") for f in errors)


@pytest.mark.parametrize("cls", [LateBoundaries, OnePairLess, OneSinkLess])
def test_a_wrong_cache_or_sinks_fail_only_with_them_on(cls):
    check_kernel(cls, {"window": 5})  # the window hybrid alone is right
    with pytest.raises(AssertionError, match=rf"check_kernel\('{cls.name}'\): [^:]*{TAG}"):
        check_kernel(cls, KIT)


@pytest.mark.parametrize("cls, form", [(SequenceMean, f"causal {TAG}"),
                                       (AcceptsBidirectional, rf"bidirectional {TAG} [^:]*\(refused")])
def test_a_wrong_kernel_fails_with_the_cache_on(cls, form):
    with pytest.raises(AssertionError, match=rf"check_kernel\('{cls.name}'\): {form}"):
        check_kernel(cls, KIT)


def _kernel(**params):
    kern = build_kernel("hedgehog", LayerShape(4, 2, 8, 0, 4096), {"chunk_size": 8, **params}).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in kern.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return kern


def _softmax(q, k, v, mask):
    hq, hkv, n = q.shape[1], k.shape[1], q.shape[2]
    logits = q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    vis = torch.ones(n, n, dtype=torch.bool).tril() & mask[:, None, None, :]
    weights = logits.masked_fill(~vis, float("-inf")).softmax(-1)
    return (weights @ v.repeat_interleave(hq // hkv, 1)).transpose(1, 2)


@pytest.mark.parametrize("params", [dict(window=2, sparse_cache=40, sparse_block=1), dict(window=2, sinks=40),
                                    dict(window=40)])
def test_the_reference_is_softmax_when_every_key_is_exact(params):
    """A cache that holds every key that left the window (C ≥ N, chosen every position), sinks covering the row,
    or a window covering it: the reference and the kernel are exact softmax."""
    kern = _kernel(**params)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 19, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :4] = False
    want = _softmax(q, k, v, mask)
    torch.testing.assert_close(hybrid_reference(kern, q, k, v, mask)[mask], want[mask])
    torch.testing.assert_close(kern(q, k, v, key_mask=mask, causal=True)[mask], want[mask])


def test_the_reference_cache_and_refusal():
    """The cache fills to C pairs of real, non-sink keys that left the window, changes the output, and a
    bidirectional call is refused."""
    kern = _kernel(**KIT)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 21, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    mask = torch.ones(1, 21, dtype=torch.bool)
    mask[0, :3] = False
    history = cache_history(kern.features(q, k, 8 ** -0.5)[1], v, mask, HybridRule.of(kern.options))
    for h in range(2):
        last = history[0][h][-1]
        assert len(last) == 3 and all(3 + 2 <= j <= 20 - 5 for j in last)  # past the pads and the sinks 3, 4
        # pads 0-2, sinks 3-4: boundaries 4 and 8 have no candidate, 12 takes 5, 6, 7 (the pool fits C = 3)
        assert all(not c for c in history[0][h][:12]) and history[0][h][12] == {5, 6, 7}
    plain = _kernel(**{**KIT, "sparse_cache": 0})
    assert not torch.allclose(hybrid_reference(kern, q, k, v, mask), hybrid_reference(plain, q, k, v, mask))
    with pytest.raises(ValueError, match="causal only"):
        hybrid_reference(kern, q, k, v, mask, causal=False)
