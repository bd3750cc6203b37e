"""Sinks + window + feature map (option ``sinks`` of the window hybrid): against the float64 brute force of
tests/kernels/reference.py (the first S real keys of each row in the softmax part), gradients, decoding in pieces,
and cached generation on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from hf_kernel_attn.kernels.linear import PastKeys, cost
from tests.kernels.window_helpers import assert_gradients_match, compare, inputs, make, padding


@pytest.mark.parametrize("name", ["elu", "dijiang", "hedgehog", "cosformer", "liger", "gla"])
@pytest.mark.parametrize("window_size, sinks", [(1, 1), (7, 4), (20, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_sinks_against_brute_force(name, window_size, sinks, causal, monkeypatch):
    """GQA 4/2, key padding (the sinks are each row's first real keys), N = M and N < M, several chunks and
    blocks."""
    monkeypatch.setattr(cost, "BAND_SCORE_VALUES", 4096)
    kern = make(name, window_size, sinks=sinks)
    for n, m in [(90, 90), (9, 70)]:
        q, k, v = inputs(2, 4, 2, n, m)
        compare(kern, q, k, v, padding(2, m, causal), causal, 1e-10)
        compare(kern, q, k, v, None, causal, 1e-10)


def test_sinks_change_the_output():
    """The sinks matter: with W = 8, S = 4 the output equals the window hybrid's for queries 0 … 7 (every key they
    see is in their window) and differs for every later query (key 0 is outside its window)."""
    q, k, v = inputs(1, 4, 2, 40, 40)
    plain, sunk = make("hedgehog", 8), make("hedgehog", 8, sinks=4)
    sunk.load_state_dict(plain.state_dict())
    a, b = plain(q, k, v, causal=True), sunk(q, k, v, causal=True)
    assert (a[:, :8] - b[:, :8]).abs().max() < 1e-12
    assert (a[:, 8:] - b[:, 8:]).abs().amax((-1, -2)).min() > 1e-6


@pytest.mark.parametrize("name", ["hedgehog", "gla"])
def test_sinks_gradients_match_brute_force(name):
    assert_gradients_match(make(name, 5, sinks=3), 40)


@pytest.mark.parametrize("name", ["hedgehog", "dijiang", "liger", "gla"])
def test_sinks_decoding_in_pieces_equals_one_pass(name):
    """The state carries the sinks: pieces (the kept W - 1 keys first) with left padding that covers the
    first pieces give the one-pass outputs."""
    window_size = 5
    kern = make(name, window_size, sinks=3, chunk_size=8)
    q, k, v = inputs(2, 4, 2, 41, 41, seed=5)
    mask = torch.ones(2, 41, dtype=torch.bool)
    mask[1, :12] = False  # row 1: its sinks are at 12, 13, 14, after two whole pieces of padding
    full = kern(q, k, v, key_mask=mask, causal=True)
    state, start, pos, outs = None, 0, 0, []
    for piece in (6, 5, 1, 7, 1, 1, 1, 19):
        ks, vs = k[:, :, start:pos + piece], v[:, :, start:pos + piece]
        out, state = kern.forward_with_state(q[:, :, pos:pos + piece], ks, vs, key_mask=mask[:, start:pos + piece],
                                             causal=True, past=PastKeys(state, start))
        outs.append(out)
        pos += piece
        start = max(0, pos - (window_size - 1))
    assert state.sinks is not None and state.sinks.valid.all()
    assert state.sinks.pos.tolist() == [[0, 1, 2], [12, 13, 14]]
    rows = mask[:, :, None, None]
    assert ((torch.cat(outs, 1) - full).abs() * rows).max().item() <= 1e-12


def test_bad_sink_options():
    from hf_kernel_attn.kernels import LayerShape, build_kernel

    for params, message in [({"sinks": 4}, "sinks=4 needs a window > 0"),
                            ({"window": 8, "sinks": -1}, r"sinks must be an integer in \[0, "),
                            ({"window": 8, "sinks": 1.5}, r"sinks must be an integer in \[0, ")]:
        with pytest.raises(ValueError, match=message):
            build_kernel("hedgehog", LayerShape(4, 2, 8, 0, 128), params)

# SmolLM2 (cached generation after a 2k prompt with sinks + window): tests/kernels/test_softmax_heads.py
