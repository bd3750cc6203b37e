"""Sliding-window softmax with attention sinks (softmax options ``window`` / ``sinks``): the kernel against the
float64 brute force of tests/kernels/reference.py (a visibility mask built entry by entry), its cost (banded SDPA calls,
K/V never repeated), the bounded decode cache (cache.WindowKVLayer) against recomputation, and bad options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn.integration.cache import (
    RecurrentStateCache,
    RecurrentStateLayer,
    WindowKVLayer,
    wants_state_cache,
)
from hf_kernel_attn.kernels import LayerShape, build_kernel, softmax
from tests.compat import cache_arg, needs_state_cache
from tests.kernels import reference as ref
from tests.kernels.helpers import make_mask

D, DV = 8, 5
SCALING = 0.3  # not D^-1/2: a kernel ignoring `scaling` is caught


def make(window, sinks=0, hq=4, hkv=2):
    return build_kernel("softmax", LayerShape(hq, hkv, D, 0, 4096), {"window": window, "sinks": sinks})


def inputs(b, hq, hkv, n, m, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, D, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, m, D, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, m, DV, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padding(b, m, causal, pad=5):
    """Row 1 padded: on the left for decoders, on the right for encoders; row 0 unpadded."""
    return make_mask(b, m, causal, pad)


@pytest.fixture
def small_chunks(monkeypatch):
    """Query chunks of 8: several chunks (and bands that start mid-sequence) at test lengths."""
    monkeypatch.setattr(softmax, "MIN_QUERY_CHUNK", 8)
    monkeypatch.setattr(softmax, "QUERY_CHUNK", 8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("sinks", [0, 1, 4])
def test_against_brute_force(causal, window, sinks, small_chunks):
    """GQA 4/2, N = M and N < M (bottom-right aligned), with and without (left / right) padding; fp32 ≤ 1e-5."""
    kern = make(window, sinks)
    for n, m in [(50, 50), (9, 50), (1, 50), (30, 30)]:
        q, k, v = inputs(2, 4, 2, n, m, seed=n + m)
        for mask in (None, padding(2, m, causal)):
            out = kern(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
            assert out.shape == (2, n, 4, DV) and out.dtype == torch.float32
            assert torch.isfinite(out).all()  # pad rows without a visible key stay finite
            want = ref.softmax_ref(kern, q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
            rows = ref.real_queries(2, n, m, causal, mask)
            err = (out.double() - want).abs()[rows].max().item()
            assert err <= 1e-5, (n, m, mask is not None, err)


def test_reference_mask_is_what_the_docstring_says():
    """The brute-force mask itself, on a case worked out by hand: W = 3, S = 2, row 1 left-padded by 2."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    vis = ref.window_sink_visible(2, 7, 7, True, mask, window=3, sinks=2)[:, 0].int()
    assert vis[0, 6].tolist() == [1, 1, 0, 0, 1, 1, 1]  # sinks 0, 1 and the window 4..6
    assert vis[1, 6].tolist() == [0, 0, 1, 1, 1, 1, 1]  # sinks are the first real tokens 2, 3
    assert vis[1, 3].tolist() == [0, 0, 1, 1, 0, 0, 0]  # causal: nothing after position 3
    assert vis[1, 1].sum() == 0  # a pad query sees nothing
    bi = ref.window_sink_visible(1, 7, 7, False, None, window=2, sinks=1)[0, 0].int()
    assert bi[4].tolist() == [1, 0, 0, 1, 1, 1, 0]


def test_window_changes_the_result_and_sinks_matter():
    """Positive controls: the window and the sinks both change the output (so the comparisons above can fail)."""
    q, k, v = inputs(1, 4, 2, 40, 40, seed=3)
    plain = make(0)(q, k, v, scaling=SCALING)
    windowed = make(5)(q, k, v, scaling=SCALING)
    sinked = make(5, 2)(q, k, v, scaling=SCALING)
    assert (plain - windowed)[:, 10:].abs().max() > 1e-2
    assert (windowed - sinked)[:, 10:].abs().max() > 1e-2
    assert torch.equal(windowed[:, :5], plain[:, :5])  # the first W queries see every earlier key anyway


@pytest.mark.parametrize("causal", [True, False])
def test_window_covering_the_keys_is_plain_softmax(causal):
    """W ≥ M (with or without sinks) takes the fused path: identical to window = 0."""
    q, k, v = inputs(2, 4, 2, 30, 30, seed=4)
    mask = padding(2, 30, causal)
    plain = make(0)(q, k, v, key_mask=mask, causal=causal, scaling=SCALING)
    for window, sinks in [(30, 0), (31, 4), (1000, 1)]:
        assert torch.equal(make(window, sinks)(q, k, v, key_mask=mask, causal=causal, scaling=SCALING), plain)


def test_cost_is_banded_and_kv_is_never_repeated(monkeypatch):
    """Every SDPA call sees at most C queries × (C + W - 1 + S) keys of the KV heads (never N × N, never repeated
    K/V), so the prefill is O(N·(W + C + S))."""
    calls = []
    orig = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[-2], k.shape[1], k.shape[-2], kw.get("enable_gqa")))
        return orig(q, k, v, **kw)

    monkeypatch.setattr(softmax.F, "scaled_dot_product_attention", spy)
    n, window, sinks = 600, 16, 4
    c = softmax.query_chunk(window, n)
    q, k, v = inputs(2, 4, 2, n, n, seed=5)
    make(window, sinks)(q, k, v, key_mask=padding(2, n, True), causal=True)
    assert len(calls) == -(-n // c) > 1
    assert all(nq <= c and hkv == 2 and nk <= c + window - 1 + sinks and gqa for nq, hkv, nk, gqa in calls)


def test_dropout_is_applied_in_the_windowed_form():
    q, k, v = inputs(1, 4, 2, 40, 40, seed=6)
    kern = make(5, 1)
    base = kern(q, k, v, scaling=SCALING)
    torch.manual_seed(0)
    dropped = kern(q, k, v, scaling=SCALING, dropout=0.5)
    assert torch.isfinite(dropped).all() and (dropped - base).abs().max() > 1e-3


@pytest.mark.parametrize("bad, message", [
    ({"window": -1}, r"window must be an integer in \[0, "),
    ({"window": 2.5}, r"window must be an integer in \[0, "),
    ({"window": True}, r"window must be an integer in \[0, "),
    ({"window": "8"}, r"window must be an integer in \[0, "),
    ({"window": 8, "sinks": -2}, r"sinks must be an integer in \[0, "),
    ({"window": 8, "sinks": False}, r"sinks must be an integer in \[0, "),
    ({"sinks": 4}, r"sinks=4 needs a window > 0.*window=W"),
    ({"window": 8, "sink": 4}, r"unknown option\(s\) \['sink'\] for kernel 'softmax'.*'window', 'sinks'"),
])
def test_bad_options(bad, message):
    with pytest.raises(ValueError, match=message):
        build_kernel("softmax", LayerShape(4, 2, D), bad)


# ------------------------------------------------------------------------------------------- the cache


def tiny_llama(num_layers=2, **patch_kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked attention (random init is near-uniform), so the window matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    if patch_kw:
        hf_kernel_attn.patch(model, **patch_kw)
    return model


GREEDY = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)


@needs_state_cache
def test_cached_generation_equals_recomputation_and_memory_is_constant():
    """window 8, sinks 2, 60 new tokens (the window slides far past the prompt): the bounded cache gives the tokens
    and logits of use_cache=False; its bytes after 60 tokens equal those after 20; positive control: plain softmax
    generates something else."""
    model = tiny_llama(kernel="softmax", window=8, sinks=2)
    assert wants_state_cache(model)
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for n in (20, 60):
        cache = RecurrentStateCache(model)
        assert [type(layer) for layer in cache.layers] == [WindowKVLayer, WindowKVLayer]
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **cache_arg(cache), **GREEDY)
        assert cache.get_seq_length() == 6 + n - 1
        assert all(layer.recent_keys.shape[-2] == 7 and layer.sink_keys.shape[-2] == 2 for layer in cache.layers)
        sizes[n] = cache.nbytes()
    assert sizes[20] == sizes[60] > 0
    full = model.generate(ids, max_new_tokens=60, min_new_tokens=60, use_cache=False, **GREEDY)
    assert torch.equal(out.sequences, full.sequences)
    assert (torch.stack(out.logits) - torch.stack(full.logits)).abs().max().item() <= 1e-4
    # generate builds the cache itself (no cache argument) and gives the same tokens
    auto = model.generate(ids, max_new_tokens=60, min_new_tokens=60, **GREEDY)
    assert torch.equal(auto.sequences, full.sequences)
    hf_kernel_attn.patch(model, kernel="softmax")
    assert not wants_state_cache(model)
    plain = model.generate(ids, max_new_tokens=60, min_new_tokens=60, **GREEDY)
    assert not torch.equal(plain.sequences, full.sequences)


@needs_state_cache
def test_left_padded_batch_generates_like_each_row_alone():
    """2 rows of different lengths, left-padded: each row's tokens equal running that row alone (the sinks of the
    padded row are its first real tokens, not the pad positions)."""
    model = tiny_llama(kernel="softmax", window=6, sinks=2)
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = RecurrentStateCache(model)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25, **cache_arg(cache), **GREEDY)
    assert cache.layers[0].sink_pos.tolist() == [[0, 1], [4, 5]]
    for row, pad in ((0, 0), (1, 4)):
        alone = model.generate(ids[row:row + 1, pad:], max_new_tokens=25, min_new_tokens=25, **GREEDY)
        assert torch.equal(alone.sequences[0], batch.sequences[row, pad:])
        diff = (torch.stack(alone.logits)[:, 0] - torch.stack(batch.logits)[:, row]).abs().max().item()
        assert diff <= 1e-4
    full = model.generate(ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25, use_cache=False, **GREEDY)
    assert torch.equal(full.sequences, batch.sequences)


@needs_state_cache
def test_chunked_prefill_and_a_user_dynamic_cache_match_one_full_forward():
    """Prefill 30 tokens, then a 13-token chunk, then single tokens (one row left-padded): the logits equal one
    forward over everything (no cache); a DynamicCache the user passes (all keys kept, the kernel applies the
    window itself, bottom-right aligned) gives them too."""
    model = tiny_llama(kernel="softmax", window=8, sinks=3).double()
    ids = torch.randint(1, 97, (2, 46), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for cache in (RecurrentStateCache(model), DynamicCache(config=model.config)):
            got, start = [], 0
            for piece in (30, 13, 1, 1, 1):
                end = start + piece
                out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=pos[:, start:end],
                            **cache_arg(cache), use_cache=True)
                got.append(out.logits)
                start = end
            real = mask.bool()
            assert (torch.cat(got, 1) - want)[real].abs().max().item() <= 1e-10
            if isinstance(cache, RecurrentStateCache):
                assert all(isinstance(layer, WindowKVLayer) and layer.recent_keys.shape[-2] == 7
                           for layer in cache.layers)
            else:
                assert cache.layers[0].keys.shape[-2] == 46  # every key kept: the kernel applied the window


@needs_state_cache
def test_beam_search_sampling_and_cache_edits():
    """Beam search (reorder_cache) and sampling with num_return_sequences (batch_repeat_interleave) give the
    sequences of recomputation; batch_select_indices continues like recomputing the selected rows."""
    model = tiny_llama(kernel="softmax", window=5, sinks=1).double()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12)
    beams = model.generate(ids, num_beams=3, do_sample=False, **kw)
    assert torch.equal(beams, model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **kw))
    sample_kw = dict(do_sample=True, num_return_sequences=2, temperature=1.5, top_k=0, top_p=1.0, **kw)
    torch.manual_seed(5)
    cached = model.generate(ids, **sample_kw)
    torch.manual_seed(5)
    full = model.generate(ids, use_cache=False, **sample_kw)
    assert cached.shape == (4, 21) and torch.equal(cached, full)
    with torch.no_grad():
        cache = RecurrentStateCache(model)
        model(ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
        cache.batch_select_indices(torch.tensor([1]))
        nxt = torch.tensor([[7]])
        step = model(nxt, attention_mask=torch.cat([mask[1:], torch.ones(1, 1, dtype=mask.dtype)], 1),
                     position_ids=torch.tensor([[6]]), **cache_arg(cache), use_cache=True).logits[:, -1]
        again = model(torch.cat([ids[1:, 3:], nxt], 1), use_cache=False).logits[:, -1]
    assert (step - again).abs().max().item() <= 1e-10


@needs_state_cache
def test_hybrid_cache_layers_and_generation():
    """softmax window / linear / plain softmax layers: WindowKVLayer, RecurrentStateLayer, DynamicLayer."""
    model = tiny_llama(num_layers=3, kernel="softmax", window=6, sinks=2, layers={1: "elu", 2: "softmax"})
    cache = RecurrentStateCache(model)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["WindowKVLayer", "RecurrentStateLayer", "DynamicLayer"]
    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=15, min_new_tokens=15, do_sample=False)
    assert torch.equal(model.generate(ids, **cache_arg(cache), **kw), model.generate(ids, use_cache=False, **kw))
    assert isinstance(cache.layers[1], RecurrentStateLayer) and cache.layers[2].keys.shape[-2] == 21


@needs_state_cache
def test_unsupported_operations_raise():
    model = tiny_llama(kernel="softmax", window=4, sinks=1)
    cache = RecurrentStateCache(model)
    model.generate(torch.randint(1, 97, (1, 5)), max_new_tokens=2, **cache_arg(cache))
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    hf_kernel_attn.patch(model, kernel="softmax", window=5, sinks=1)
    with pytest.raises(ValueError, match="built for softmax with window 4 and sinks 1.*window 5"):
        model(torch.randint(1, 97, (1, 1)), **cache_arg(cache), use_cache=True)
    with pytest.raises(ValueError, match="at least one linear kernel or one softmax kernel with a window"):
        RecurrentStateCache(tiny_llama(kernel="softmax"))


@pytest.mark.real_model
def test_smollm2_window_covering_the_text_equals_softmax(smollm2, smollm2_tok, fresh):
    """W ≥ N on a ~100-token input: SmolLM2's logits are those of plain softmax (bit-identical: the fused path)."""
    fresh(smollm2)
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
            "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
            "Locally nicknamed the Iron Lady, it was constructed as the centrepiece of the 1889 World's Fair, and "
            "to crown the centennial anniversary of the French Revolution. Although initially criticised by some of "
            "France's leading artists and intellectuals for its design, it has since become a global icon.")
    ids = smollm2_tok([text], return_tensors="pt").input_ids
    assert 90 <= ids.shape[1] <= 130
    with torch.no_grad():
        hf_kernel_attn.patch(smollm2, kernel="softmax")
        want = smollm2(ids).logits
        hf_kernel_attn.patch(smollm2, kernel="softmax", window=ids.shape[1], sinks=4)
        got = smollm2(ids).logits
        hf_kernel_attn.patch(smollm2, kernel="softmax", window=16, sinks=4)
        narrow = smollm2(ids).logits
    assert (got - want).abs().max().item() <= 1e-6
    assert (narrow - want).abs().max().item() > 1e-2  # positive control: a window shorter than the text differs
