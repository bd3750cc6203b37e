"""KV-cache press baselines (hf_kernel_attn.evaluation.presses): the byte arithmetic and the project's own score
everywhere; with kvpress installed (it pins transformers<5.3, so usually a separate environment), on SmolLM2: a
press at ratio 0.5 halves the cache after the context, a byte target lands on its bytes, and the runner's greedy
answer equals kvpress's own ``kv-press-text-generation`` pipeline on the same prompt."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig

from hf_kernel_attn.evaluation import presses
from hf_kernel_attn.evaluation.presses import (
    kv_bytes_per_token,
    make_press,
    press_runner,
    ratio_for_bytes,
    recall_error_scores,
    require_kvpress,
)


def _kvpress_usable() -> bool:
    try:
        require_kvpress()
    except ImportError:
        return False
    return True


needs_kvpress = pytest.mark.skipif(not _kvpress_usable(),
                                   reason="kvpress is not installed here (or this transformers is outside its pin)")

CONTEXT = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 6
           + "The special magic number for apple is 4821937. "
           + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 6)
QUESTION = "What is the special magic number for apple?"


def _config(**kw) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                       head_dim=64, **kw)


def test_bytes_per_token_and_the_ratio_that_lands_on_a_byte_target():
    config = _config()
    assert kv_bytes_per_token(config, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(config, "bfloat16") == 2 * 30 * 3 * 64 * 2
    per = kv_bytes_per_token(config, torch.float32)
    for n in (17, 300, 617, 1024, 8191):
        for keep in (1, 5, n // 3, n - 1):
            r = ratio_for_bytes(keep * per + per // 2, config, n, dtype=torch.float32)
            assert 0 <= r < 1 and int(n * (1 - r)) == keep  # kvpress's own count of kept pairs
            r = ratio_for_bytes((keep + 7) * per, config, n, dtype=torch.float32, extra_tokens=7)
            assert int(n * (1 - r)) == keep
    assert ratio_for_bytes(10**12, config, 617) == 0.0  # the whole context fits: no compression
    with pytest.raises(ValueError, match="not enough"):
        ratio_for_bytes(per - 1, config, 617, dtype=torch.float32)


def test_a_missing_kvpress_names_the_install_and_the_transformers_pin(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install kvpress.*transformers.*5\.3"):
        require_kvpress()
    with pytest.raises(ImportError, match="pip install kvpress"):
        make_press("snapkv", 0.5)


def test_bad_press_names_and_ratios_are_refused_before_kvpress_is_needed():
    with pytest.raises(ValueError, match="compression ratio"):
        make_press("snapkv", 1.0)
    with pytest.raises(ValueError, match="streaming_llm"):  # the unknown-name error lists the presses
        make_press("no_such_press", 0.5)
    assert {"streaming_llm", "snapkv", "tova", "kvzip", "expected_attention", "sparse_cache"} <= set(
        presses.press_names())


def test_the_sparse_cache_score_keeps_sinks_and_window_and_ranks_a_lone_pair_first():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 40, 8) * 0.1
    values = torch.zeros(1, 2, 40, 8)
    keys[:, :, 20], values[:, :, 20] = 3.0, 5.0  # one pair unlike the others: the state reproduces it worst
    scores = recall_error_scores(keys, values, n_sink=4, window=8)
    assert scores.shape == (1, 2, 40)
    top = scores.amax()
    assert (scores[..., :4] == top).all() and (scores[..., -8:] == top).all()
    middle = scores[..., 4:32]
    assert (middle.argmax(-1) == 16).all() and (middle < top).all()
    assert torch.isfinite(recall_error_scores(keys[:, :, :10], values[:, :, :10], n_sink=4, window=8)).all()


# ------------------------------------------------------------------------------------------- with kvpress
@pytest.fixture(scope="module")
def prompt(smollm2, smollm2_tok):
    """Context and question ids as kvpress's pipeline makes them (chat template split at the question)."""
    from transformers import pipeline

    pipe = pipeline("kv-press-text-generation", model=smollm2, tokenizer=smollm2_tok)
    ids = pipe.preprocess(CONTEXT, questions=[QUESTION], answer_prefix="", max_context_length=10**9)
    attn = [layer.self_attn for layer in smollm2.model.layers]
    before = [set(m._modules) for m in attn]
    yield pipe, ids["context_ids"][0], ids["questions_ids"][0][0]
    for module, names in zip(attn, before, strict=True):  # kvpress's pipeline leaves rotary_emb on each layer
        for extra in set(module._modules) - names:
            del module._modules[extra]


def _full_bytes(model, context) -> int:
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=context[None], past_key_values=cache)
    return presses.cache_bytes(cache)


@needs_kvpress
@pytest.mark.real_model
@pytest.mark.slow(15)
@pytest.mark.parametrize("name", ["streaming_llm", "snapkv", "sparse_cache", "kvzip"])
def test_a_press_at_ratio_half_halves_the_cache_after_the_context(name, smollm2, prompt):
    _, context, question = prompt
    n = context.shape[0]
    full = _full_bytes(smollm2, context)
    assert full == n * kv_bytes_per_token(smollm2.config, smollm2.dtype)
    attn = [layer.self_attn for layer in smollm2.model.layers]
    before = [sorted(m._modules) for m in attn]
    with press_runner(smollm2, name, 0.5) as run:
        out = run.generate(context, question, max_new_tokens=2)
    assert [sorted(m._modules) for m in attn] == before  # the model is given back as it was
    assert all(getattr(m, "masked_key_indices", None) is None for m in attn)
    if name == "kvzip":  # masks instead of freeing: the kept share, counted per head across layers
        assert out.kept_tokens == n and abs(out.cache_bytes / full - 0.5) < 0.01
    else:
        assert out.kept_tokens == int(n * 0.5)
        assert out.cache_bytes == full * out.kept_tokens // n and abs(out.cache_bytes / full - 0.5) <= 1 / n


@needs_kvpress
@pytest.mark.real_model
@pytest.mark.slow(10)
def test_a_byte_target_lands_on_its_bytes(smollm2, prompt):
    _, context, question = prompt
    per = kv_bytes_per_token(smollm2.config, smollm2.dtype)
    with press_runner(smollm2, "snapkv", target_bytes=100 * per) as run:
        out = run.generate(context, question, max_new_tokens=1)
        assert out.kept_tokens == 100 and out.cache_bytes == 100 * per
        out = run.generate(context, question, max_new_tokens=1, budget_includes_question=True)
        assert out.kept_tokens == 100 - question.shape[0]


@needs_kvpress
@pytest.mark.real_model
@pytest.mark.slow(40)
@pytest.mark.parametrize("name", ["snapkv", "sparse_cache"])
def test_the_runner_answers_as_kvpress_own_pipeline(name, smollm2, smollm2_tok, prompt):
    pipe, context, question = prompt
    expected = pipe(CONTEXT, question=QUESTION, press=make_press(name, 0.5), max_new_tokens=12)["answer"]
    with press_runner(smollm2, name, 0.5) as run:
        out = run.generate(context, question, max_new_tokens=12)
    assert smollm2_tok.decode(out.tokens, skip_special_tokens=True) == expected
