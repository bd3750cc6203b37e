"""RecurrentStateCache: constant-memory decoding equals full recomputation (SmolLM2 and tiny Llama)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn.integration.cache import RecurrentStateCache, RecurrentStateLayer
from hf_kernel_attn.kernels import KERNELS
from hf_kernel_attn.kernels.linear import PastKeys
from tests.compat import cache_arg, enable_checkpointing, needs_state_cache

LINEAR = sorted(n for n, c in KERNELS.items() if c.is_linear)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived", "Hi"]


def generate_both(model, batch, new_tokens):
    """Greedy decoding with the automatic state cache and with step-by-step full recomputation."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    cached = model.generate(**batch, **kw)
    full = model.generate(**batch, use_cache=False, **kw)
    return cached.sequences, torch.stack(cached.logits, 1), full.sequences, torch.stack(full.logits, 1)


@pytest.fixture(scope="module")
def smollm2_batch(smollm2_tok):
    return smollm2_tok(PROMPTS, return_tensors="pt", padding=True)


@pytest.mark.real_model
@pytest.mark.parametrize("kernel", LINEAR)
def test_state_cache_generation_matches_recomputation(kernel, smollm2, smollm2_batch, fresh):
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel=kernel)
    seq_c, logit_c, seq_f, logit_f = generate_both(smollm2, smollm2_batch, 6)
    assert torch.equal(seq_c, seq_f)
    # fp32 accumulation order differs between the chunked and the recurrent form: ~1e-4 relative noise
    assert (logit_c - logit_f).abs().max().item() <= 5e-4 * logit_f.abs().max().item()


@pytest.mark.real_model
@pytest.mark.parametrize("kernel", ["cosformer", "dijiang"])
def test_state_cache_exact_in_float64(kernel, smollm2, smollm2_batch, fresh):
    """In fp64 the recurrent state and full recomputation agree to rounding (positions and decay included)."""
    fresh(smollm2)
    smollm2.double()
    try:
        hf_kernel_attn.patch(smollm2, kernel=kernel)
        seq_c, logit_c, seq_f, logit_f = generate_both(smollm2, smollm2_batch, 8)
    finally:
        smollm2.float()
    assert torch.equal(seq_c, seq_f)
    assert (logit_c - logit_f).abs().max().item() <= 1e-4


@pytest.mark.real_model
def test_hybrid_model_generates_like_recomputation(smollm2, smollm2_batch, fresh):
    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel="hedgehog", layers={0: "softmax", -1: "softmax"})
    cache = RecurrentStateCache(smollm2)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[0] == kinds[-1] == "DynamicLayer" and set(kinds[1:-1]) == {"RecurrentStateLayer"}
    seq_c, logit_c, seq_f, logit_f = generate_both(smollm2, smollm2_batch, 6)
    assert torch.equal(seq_c, seq_f)
    assert (logit_c - logit_f).abs().max().item() <= 5e-4 * logit_f.abs().max().item()


def tiny_llama(kernel="elu"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    hf_kernel_attn.patch(model, kernel=kernel)
    return model


@needs_state_cache
def test_generate_uses_state_cache_and_memory_is_constant():
    model = tiny_llama("hedgehog")
    ids = torch.randint(1, 97, (2, 7))
    sizes = {}
    for n in (64, 1024):
        cache = RecurrentStateCache(model)
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache_arg(cache))
        assert all(isinstance(layer, RecurrentStateLayer) for layer in cache.layers)
        assert cache.get_seq_length() == 7 + n - 1
        sizes[n] = cache.nbytes()
    assert sizes[64] == sizes[1024] > 0
    # without a cache argument generate builds one itself
    seen = []
    orig = RecurrentStateLayer.attend
    RecurrentStateLayer.attend = lambda self, *a, **k: seen.append(1) or orig(self, *a, **k)
    try:
        model.generate(ids, max_new_tokens=3, do_sample=False)
    finally:
        RecurrentStateLayer.attend = orig
    assert seen


def test_beam_search_sampling_and_return_sequences_run():
    model = tiny_llama("performer")
    ids = torch.randint(1, 97, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False)
    multi = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2)
    assert beams.shape == (2, 11) and multi.shape == (4, 11)
    # beam search with the state cache picks the same beams as with recomputation
    again = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(beams, again)


@needs_state_cache
def test_unsupported_operations_raise():
    model = tiny_llama("elu")
    cache = RecurrentStateCache(model)
    model.generate(torch.randint(1, 97, (1, 5)), max_new_tokens=2, **cache_arg(cache))
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="at least one linear kernel"):
        RecurrentStateCache(tiny_llama("gaussian"))


@needs_state_cache
def test_training_and_no_cache_paths_stay_stateless():
    """A cache handed to a gradient-checkpointed training forward is dropped (never touched, same loss as without
    it), while the same cache in eval does fill; plain forwards without a cache carry no state between calls."""
    model = tiny_llama("dijiang")
    ids = torch.randint(1, 97, (2, 9))
    other = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        fresh_other = model(other).logits
        expected = model(ids, use_cache=False).logits
    model.train()
    enable_checkpointing(model)
    plain_loss = model(ids, labels=ids, use_cache=False).loss
    cache = RecurrentStateCache(model)
    loss = model(ids, labels=ids, **cache_arg(cache), use_cache=True).loss
    loss.backward()
    assert loss.item() == plain_loss.item()
    assert cache.get_seq_length() == 0 and all(layer.state is None for layer in cache.layers)
    # positive control: the same cache object does reach the layers when nothing drops it
    model.eval()
    with torch.no_grad():
        out = model(ids, **cache_arg(cache), use_cache=True).logits
    assert cache.get_seq_length() == 9 and all(layer.state is not None for layer in cache.layers)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # plain forwards that cache (the config's use_cache, eval mode) get a fresh recurrent cache each: nothing is
    # kept between calls
    calls = []
    orig = RecurrentStateLayer.attend
    RecurrentStateLayer.attend = lambda self, *a, **k: calls.append(1) or orig(self, *a, **k)
    try:
        with torch.no_grad():
            model(ids)
            again = model(other).logits
    finally:
        RecurrentStateLayer.attend = orig
    assert calls
    assert torch.equal(again, fresh_other)


@needs_state_cache
@pytest.mark.real_model
@pytest.mark.parametrize("kernel,params", [("hedgehog", {"window": 64}), ("elu", {})], ids=["hedgehog-w64", "elu"])
def test_plain_forward_that_caches_returns_the_recurrent_cache(kernel, params, smollm2, fresh):
    """A plain forward with use_cache=True (manual decoding loops, chunked prefill) returns the recurrent cache:
    its bytes after 128 and after 1,024 tokens are equal (state + W - 1 keys/values); decoding from it by hand
    equals generate(); a cache the caller passes is used as given."""
    from transformers import DynamicCache

    fresh(smollm2)
    hf_kernel_attn.patch(smollm2, kernel=kernel, **params)
    ids = torch.randint(100, 5000, (1, 1024), generator=torch.Generator().manual_seed(0))
    sizes = []
    with torch.no_grad():
        for n in (128, 1024):
            cache = smollm2(ids[:, :n], use_cache=True).past_key_values
            assert isinstance(cache, RecurrentStateCache)
            sizes.append(cache.nbytes())
        assert sizes[0] == sizes[1]
        layer = smollm2.model.layers[0].self_attn
        kv_heads, head_dim = smollm2.config.num_key_value_heads, layer.head_dim
        window = params.get("window", 0)
        feats = layer.kernel_attn.num_features()
        per_layer = 4 * kv_heads * (feats * (head_dim + 1) + max(0, window - 1) * 2 * head_dim)
        assert sizes[0] == per_layer * smollm2.config.num_hidden_layers
        # chunked prefill, then greedy steps by hand, vs generate()
        prompt = ids[:, :40]
        cache = smollm2(prompt[:, :25], use_cache=True).past_key_values
        out = smollm2(prompt[:, 25:], **cache_arg(cache), use_cache=True)
        tokens = []
        for _ in range(6):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            out = smollm2(nxt, cache=out.past_key_values, use_cache=True)
        generated = smollm2.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(torch.cat(tokens, 1), generated[:, 40:])
        given = DynamicCache(config=smollm2.config)
        assert smollm2(prompt, cache=given, use_cache=True).past_key_values is given


@needs_state_cache
def test_cosformer_small_horizon_prefill_and_decode_offsets():
    """Horizon 32 (a one-position shift moves cos(π/2·Δ/32) weights by up to 5%): prefill 10 tokens (one row
    left-padded), decode 20; every chunk reaches the kernel at offset = tokens seen, and the cached logits equal
    full recomputation in float64."""
    model = tiny_llama("elu").double()
    hf_kernel_attn.patch(model, kernel="cosformer", horizon=32)
    kernel_cls = type(model.model.layers[0].self_attn.kernel_attn)
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
              return_dict_in_generate=True, output_logits=True)
    seen = []
    shift = [0]
    orig = kernel_cls.forward_with_state

    def spy(self, q, k, v, **kwargs):
        past = kwargs.get("past") or PastKeys()
        seen.append((self.shape.layer_idx, past.offset, q.shape[-2]))
        if past.offset:
            kwargs["past"] = dataclasses.replace(past, offset=past.offset + shift[0])
        return orig(self, q, k, v, **kwargs)

    def cached_generate():
        cache = RecurrentStateCache(model)
        kernel_cls.forward_with_state = spy
        try:
            return model.generate(ids, **cache_arg(cache), **kw), cache
        finally:
            kernel_cls.forward_with_state = orig

    cached, cache = cached_generate()
    full = model.generate(ids, use_cache=False, **kw)
    for layer in (0, 1):
        chunks = [(offset, n) for idx, offset, n in seen if idx == layer]
        assert chunks == [(0, 10)] + [(10 + t, 1) for t in range(19)]
    assert cache.get_seq_length() == 29 and all(layer._chunk_offset == 28 for layer in cache.layers)
    assert torch.equal(cached.sequences, full.sequences)
    got, expected = torch.stack(cached.logits, 1), torch.stack(full.logits, 1)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-5 * scale
    # the comparison can fail: decode steps placed one position late move the logits far beyond 1e-5
    shift[0] = 1
    late, _ = cached_generate()
    assert (torch.stack(late.logits, 1)[:, 1] - expected[:, 1]).abs().max().item() > 1e-3 * scale


def test_sampling_and_return_sequences_match_recomputation():
    """do_sample with num_return_sequences=3: in float64 the state cache and full recomputation give the same
    logits, hence (same seed) the same draws; prompts are repeated per sample and the samples differ."""
    model = tiny_llama("performer").double()
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=True, num_return_sequences=3,
              temperature=1.5, top_k=0, top_p=1.0, return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(5)
    cached = model.generate(ids, **kw)
    torch.manual_seed(5)
    full = model.generate(ids, use_cache=False, **kw)
    assert cached.sequences.shape == (6, 14)
    assert torch.equal(cached.sequences, full.sequences)
    got, expected = torch.stack(cached.logits, 1), torch.stack(full.logits, 1)
    assert (got - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()
    assert torch.equal(cached.sequences[:, :6], ids.repeat_interleave(3, 0))
    for row in range(2):
        samples = cached.sequences[3 * row:3 * row + 3, 6:]
        assert not (torch.equal(samples[0], samples[1]) and torch.equal(samples[1], samples[2]))


@needs_state_cache
def test_cache_batch_select_repeat_and_reorder_continue_like_recomputation():
    """batch_select_indices, batch_repeat_interleave and reorder_cache on a hybrid cache (K/V layer + recurrent
    state): the next step from the edited cache equals recomputing the selected/repeated rows from scratch."""
    model = tiny_llama("elu")
    hf_kernel_attn.patch(model, kernel="dijiang", layers={0: "softmax"})
    model.double()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 97, (3, 7), generator=gen)

    def prefilled() -> RecurrentStateCache:
        cache = RecurrentStateCache(model)
        assert [type(layer).__name__ for layer in cache.layers] == ["DynamicLayer", "RecurrentStateLayer"]
        model(ids, **cache_arg(cache), use_cache=True)
        return cache

    def check(cache, rows: torch.Tensor) -> None:
        nxt = torch.randint(1, 97, (rows.numel(), 1), generator=gen)
        step = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1]
        again = model(torch.cat([ids[rows], nxt], 1), use_cache=False).logits[:, -1]
        assert cache.layers[1].state.S.shape[0] == rows.numel() == cache.layers[0].keys.shape[0]
        assert (step - again).abs().max().item() <= 1e-10 * again.abs().max().item()

    with torch.no_grad():
        cache = prefilled()
        cache.batch_select_indices(torch.tensor([2, 0]))
        check(cache, torch.tensor([2, 0]))
        cache = prefilled()
        cache.batch_repeat_interleave(2)
        check(cache, torch.tensor([0, 0, 1, 1, 2, 2]))
        cache = prefilled()
        cache.reorder_cache(torch.tensor([1, 1, 0]))
        check(cache, torch.tensor([1, 1, 0]))


@needs_state_cache
def test_decode_suite_reports_constant_state_and_growing_kv():
    from hf_kernel_attn.speed.decoding import run_decode_suite

    model = tiny_llama("elu")
    rows = run_decode_suite(model, ["elu"], [16, 64], steps=2)
    by = {(r["kernel"], r["context"]): r for r in rows}
    assert set(by) == {("softmax", 16), ("softmax", 64), ("elu", 16), ("elu", 64)}
    assert by[("elu", 16)]["cache_bytes"] == by[("elu", 64)]["cache_bytes"] > 0
    # K/V bytes grow with the context: 2 layers × (K and V) × 2 KV heads × 16 dims × 4 bytes per token
    grown = by[("softmax", 64)]["cache_bytes"] - by[("softmax", 16)]["cache_bytes"]
    assert grown == 48 * 2 * 2 * 2 * 16 * 4
    assert by[("softmax", 16)]["ratio_vs_softmax"] == 1.0 and by[("elu", 16)]["ratio_vs_shortest"] == 1.0
    assert by[("elu", 64)]["prefill_tokens_per_s"] == pytest.approx(64 / by[("elu", 64)]["prefill_s"])


@needs_state_cache
def test_decode_suite_saved_runs_the_model_as_loaded_next_to_copies():
    """``saved`` times the model with the kernels it carries (here per layer: a windowed elu with a sparse cache in
    layer 1 only), every other kernel a patched copy; the model itself is left as it was, and each row's cache is
    the one its own kernels build (the saved model's equal at both contexts, softmax's growing)."""
    from hf_kernel_attn.speed.decoding import SAVED, new_cache, run_decode_suite

    model = tiny_llama("elu")
    hf_kernel_attn.patch(model, kernel="elu", layers={0: {"kernel": "elu", "params": {"window": 4}},
                                                      1: {"kernel": "elu", "params": {"window": 4, "sparse_cache": 3}}})
    before = hf_kernel_attn.kernel_config(model).to_dict()
    rows = run_decode_suite(model, [SAVED, "elu"], [24, 48], steps=2)
    assert hf_kernel_attn.kernel_config(model).to_dict() == before
    by = {(r["kernel"], r["context"]): r for r in rows}
    assert [r["kernel"] for r in rows] == ["softmax", "softmax", SAVED, SAVED, "elu", "elu"]
    assert by[(SAVED, 24)]["cache_bytes"] == by[(SAVED, 48)]["cache_bytes"]
    assert by[("softmax", 48)]["cache_bytes"] > by[("softmax", 24)]["cache_bytes"]
    cache = new_cache(model)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 24)), **cache_arg(cache), use_cache=True)
    from hf_kernel_attn.integration.cache import cache_bytes
    assert by[(SAVED, 24)]["cache_bytes"] == cache_bytes(cache) != by[("elu", 24)]["cache_bytes"]
    hf_kernel_attn.unpatch(model)
    with pytest.raises(ValueError, match="carries none"):
        run_decode_suite(model, [SAVED], [8], steps=1)


@needs_state_cache
@pytest.mark.parametrize("kernel", ["softmax", "elu", "taylor", "hybrid"])
def test_synthetic_cache_has_the_shapes_of_a_real_prefill(kernel):
    """decode-bench --synthetic-cache: same sizes and length as a real prefill, and decoding continues."""
    from hf_kernel_attn.speed.decoding import cache_bytes, new_cache, synthetic_cache

    model = tiny_llama("elu")
    if kernel == "hybrid":
        hf_kernel_attn.patch(model, kernel="softmax", layers={1: "elu"})
    else:
        hf_kernel_attn.patch(model, kernel=kernel)
    ids = torch.randint(1, 97, (2, 40))
    real = new_cache(model)
    with torch.no_grad():
        model(ids, cache=real, use_cache=True)
        fake = synthetic_cache(model, 40, batch=2)
        assert type(fake) is type(real) and fake.get_seq_length() == real.get_seq_length() == 40
        assert cache_bytes(fake) == cache_bytes(real) > 0
        out = model(ids[:, :1], cache=fake, use_cache=True)
    assert out.logits.shape == (2, 1, 97) and torch.isfinite(out.logits).all()
    assert fake.get_seq_length() == 41


def test_synthetic_cache_needs_a_patched_model():
    from hf_kernel_attn.speed.decoding import synthetic_cache

    model = tiny_llama("elu")
    hf_kernel_attn.unpatch(model)
    with pytest.raises(ValueError, match="patched"):
        synthetic_cache(model, 8)


def test_decode_suite_extends_cosformer_horizon():
    """Contexts past max_position_embeddings: cosformer gets a horizon covering them instead of failing."""
    from hf_kernel_attn.speed.decoding import run_decode_suite

    model = tiny_llama("elu")
    model.config.max_position_embeddings = 32
    hf_kernel_attn.patch(model, kernel="elu")
    rows = run_decode_suite(model, ["cosformer"], [40], steps=2, synthetic=True)
    cos = next(r for r in rows if r["kernel"] == "cosformer")
    assert cos["params"] == {"horizon": 44} and cos["decode_ms"] > 0
