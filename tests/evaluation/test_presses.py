"""KV-cache press baselines (hf_kernel_attn.evaluation.presses): the byte arithmetic and the project's own score
everywhere, and ``eval --press``'s flags and refusals (kvpress missing included); with kvpress installed (it pins
transformers<5.3, so usually a separate environment: scripts/setup.sh --press), on SmolLM2: a press at ratio 0.5
halves the cache after the context, a byte target lands on its bytes, the runner's greedy answer equals kvpress's
own ``kv-press-text-generation`` pipeline on the same prompt, and ``eval --press`` on passkey reports those bytes
and scores the pipeline's answers."""

from __future__ import annotations

import importlib.util
import inspect
import json
import random
import statistics
import subprocess
import sys

import numpy
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn.cli import build_parser, main
from hf_kernel_attn.evaluation import presses
from hf_kernel_attn.evaluation.long_context import TASKS
from hf_kernel_attn.evaluation.long_context.base import exact_match, first_number
from hf_kernel_attn.evaluation.long_context.runner import LongContextGrid, bos_ids, press_answers, run_long_context
from hf_kernel_attn.evaluation.presses import (
    kv_bytes_per_token,
    make_press,
    press_runner,
    ratio_for_bytes,
    recall_error_scores,
    require_kvpress,
)
from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, check_press, run_eval
from hf_kernel_attn.evaluation.tasks import get_tasks


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
    with pytest.raises(ImportError, match=r"pip install 'hf_kernel_attn\[press\]'.*transformers.*5\.3"):
        require_kvpress()
    with pytest.raises(ImportError, match=r"hf_kernel_attn\[press\]"):
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


# ------------------------------------------------------------------------------- eval --press, without kvpress
def _settings(**kw) -> EvalSettings:
    return EvalSettings(lengths=[256], depths=[50], samples=1, **kw)


def _no_kvpress(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))


def test_eval_press_flags_parse():
    base = ["eval", "--model", "m", "--tasks", "passkey", "--press", "snapkv"]
    args = build_parser().parse_args([*base, "--compression", "0.25"])
    assert (args.press, args.compression, args.press_bytes) == ("snapkv", 0.25, None)
    args = build_parser().parse_args([*base, "--press-bytes", "1048576"])
    assert (args.compression, args.press_bytes) == (None, 1048576)
    args = build_parser().parse_args(["eval", "--model", "m", "--tasks", "passkey"])
    assert (args.press, args.compression, args.press_bytes) == (None, None, None)
    with pytest.raises(SystemExit):  # one of the two
        build_parser().parse_args([*base, "--compression", "0.5", "--press-bytes", "100"])


@pytest.mark.parametrize(("kw", "match"), [
    ({"press": "no_such_press", "compression": 0.5}, r"no_such_press.*snapkv.*streaming_llm"),
    ({"press": "snapkv", "compression": 1.0}, r"--compression must be in \[0, 1\), got 1\.0"),
    ({"press": "snapkv", "compression": -0.1}, r"--compression must be in \[0, 1\)"),
    ({"press": "snapkv"}, "one of --compression R"),
    ({"press": "snapkv", "compression": 0.5, "press_bytes": 10}, "one of --compression R"),
    ({"press": "snapkv", "press_bytes": 0}, "--press-bytes must be an integer >= 1"),
    ({"compression": 0.5}, "go with --press NAME"),
    ({"press_bytes": 100}, "go with --press NAME"),
])
def test_bad_press_settings_are_refused_before_a_model_loads(kw, match):
    with pytest.raises(ValueError, match=match):
        check_press(_settings(**kw), get_tasks(["passkey"]), ModelSpec("m"))
    with pytest.raises(ValueError, match=match):  # before loading: this model does not exist
        run_eval(ModelSpec("no/such-model-here"), ["passkey"], _settings(**kw))


@pytest.mark.parametrize("tasks", [["wikitext2"], ["position_loss"], ["passkey", "wikitext2"]])
def test_a_press_runs_only_the_long_context_tasks_that_ask_a_question(tasks):
    with pytest.raises(ValueError, match=r"--press runs the long-context tasks .*'passkey', 'niah', 'kv_recall'"):
        check_press(_settings(press="snapkv", compression=0.5), get_tasks(tasks))


def test_a_press_is_refused_on_a_kernel_model():
    settings = _settings(press="snapkv", compression=0.5)
    for spec in (ModelSpec("m", kernel="hedgehog"), ModelSpec("m", params={"window": 8})):
        with pytest.raises(ValueError, match="unconverted softmax model"):
            check_press(settings, get_tasks(["passkey"]), spec)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    hf_kernel_attn.patch(model, kernel="hedgehog")
    with pytest.raises(ValueError, match="unconverted softmax model; this model has the 'hedgehog' kernel attached"):
        press_runner(model, "snapkv", 0.5)


def test_the_attention_function_takes_dropout_then_scaling_by_position_like_transformers_own():
    """Wrappers that other libraries put around every registered attention function (kvpress does) call
    ``func(module, q, k, v, mask, dropout, **kwargs)``: the order is transformers' own sdpa function's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_kernel_attn.integration.attention import attention_forward

    def positional(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]

    assert positional(attention_forward) == positional(sdpa_attention_forward)[:len(positional(attention_forward))]


KERNEL_AFTER_KVPRESS = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
import hf_kernel_attn
from hf_kernel_attn.integration.attention import attention_forward
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
hf_kernel_attn.patch(model, kernel="hedgehog")
ids = torch.randint(0, 64, (2, 12))
with torch.no_grad():
    before = model(ids).logits
import kvpress  # wraps every function in ALL_ATTENTION_FUNCTIONS
assert ALL_ATTENTION_FUNCTIONS["hedgehog"] is not attention_forward, "kvpress did not wrap the kernel's function"
with torch.no_grad():
    after = model(ids).logits
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
assert torch.equal(before, after), (before - after).abs().max()
print("ok", generated.shape[1])
"""


@needs_kvpress
def test_a_kernel_model_runs_unchanged_after_kvpress_wraps_the_attention_functions():
    """kvpress, once imported, wraps every registered attention function and passes ``dropout`` by position;
    a kernel model in the same process must keep its output (it raised 'got multiple values for scaling')."""
    done = subprocess.run([sys.executable, "-c", KERNEL_AFTER_KVPRESS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "16"]


def test_eval_press_without_kvpress_prints_the_install_line(monkeypatch, capsys, smollm2_dir):
    _no_kvpress(monkeypatch)
    argv = ["eval", "--model", str(smollm2_dir), "--tasks", "passkey", "--lengths", "256", "--press", "snapkv"]
    assert main([*argv, "--compression", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install 'hf_kernel_attn[press]'" in err and "transformers" in err
    assert main([*argv[:-1], "nope", "--compression", "0.5"]) == 2  # the name is checked first
    assert "streaming_llm" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"hf_kernel_attn\[press\]"):
        check_press(_settings(press="snapkv", compression=0.5), get_tasks(["passkey"]))


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


def _cell(tokenizer, task: str, length: int, samples: int):
    """The prompts ``eval`` builds for one (length, depth 50) cell, seed 0."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    return TASKS[task].samples(encode, length, 50, samples, 0, bos=bos_ids(tokenizer))


@needs_kvpress
@pytest.mark.real_model
@pytest.mark.slow(60)
def test_eval_press_on_passkey_halves_the_bytes_and_scores_kvpress_own_answers(smollm2_dir, smollm2, smollm2_tok,
                                                                                prompt, tmp_path):
    """``eval --press snapkv --compression 0.5`` on passkey: the record's cache bytes after the context are half a
    full cache's (up to kvpress's floor), and its score is that of kvpress's own pipeline's answers (its forward
    on the same context and question ids), which the runner's answers equal token for token."""
    pipe, ratio, out = prompt[0], 0.5, tmp_path / "press.jsonl"
    assert main(["eval", "--model", str(smollm2_dir), "--tasks", "passkey", "--lengths", "256", "--depths", "50",
                 "--samples", "2", "--press", "snapkv", "--compression", str(ratio), "--output", str(out)]) == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (rec["kernel"], rec["press"], rec["compression"], rec["press_bytes"]) == ("softmax", "snapkv", ratio, None)
    cell = _cell(smollm2_tok, "passkey", 256, 2)
    per = kv_bytes_per_token(smollm2.config, smollm2.dtype)
    for s in cell:
        assert _full_bytes(smollm2, torch.tensor(s.ids[:s.question_start])) == s.question_start * per
    full = statistics.fmean(s.question_start * per for s in cell)
    assert rec["cache_bytes"] == round(statistics.fmean(int(s.question_start * (1 - ratio)) * per for s in cell))
    assert abs(rec["cache_bytes"] / full - (1 - ratio)) <= 1 / min(s.question_start for s in cell)
    new_tokens = TASKS["passkey"].answer_digits + 4
    expected = [pipe.forward({"context_ids": torch.tensor([s.ids[:s.question_start]]),
                              "questions_ids": [torch.tensor([s.ids[s.question_start:]])]},
                             press=make_press("snapkv", ratio), max_new_tokens=new_tokens)[0] for s in cell]
    with press_runner(smollm2, "snapkv", ratio) as run:
        got = [smollm2_tok.decode(r.tokens, skip_special_tokens=True) for r in press_answers(run, cell, new_tokens)]
    assert got == expected
    scores = [exact_match(first_number(a), s.answers[0]) for a, s in zip(expected, cell, strict=True)]
    assert rec["value"] == 100 * sum(scores) / len(scores) and rec["n"] == 2


@needs_kvpress
@pytest.mark.real_model
@pytest.mark.slow(20)
def test_teacher_forced_queries_after_a_press(smollm2, smollm2_tok):
    """kv_recall with a press: ratio 0 predicts every query token as the whole prompt's forward does; a byte
    target leaves those bytes after the context."""
    grid = LongContextGrid([256], [50], 1, 0)
    (s,) = _cell(smollm2_tok, "kv_recall", 256, 1)
    start = s.question_start
    with press_runner(smollm2, "streaming_llm", 0.0) as run:
        _, pred = run.predict(s.ids[:start], s.ids[start:])
        pressed = run_long_context(smollm2, smollm2_tok, "kv_recall", grid, press=run)
    with torch.no_grad():
        whole = smollm2(input_ids=torch.tensor([s.ids])).logits[0, start:].argmax(-1)
    assert torch.equal(pred, whole)
    plain = run_long_context(smollm2, smollm2_tok, "kv_recall", grid)
    assert [(r["metric"], r["value"]) for r in pressed] == [(r["metric"], r["value"]) for r in plain]
    per = kv_bytes_per_token(smollm2.config, smollm2.dtype)
    assert pressed[0]["cache_bytes"] == start * per and pressed[0]["compression"] == 0.0
    with press_runner(smollm2, "sparse_cache", target_bytes=100 * per) as run:
        (rec, *_) = run_long_context(smollm2, smollm2_tok, "kv_recall", grid, press=run)
    assert rec["cache_bytes"] == 100 * per and rec["press_bytes"] == 100 * per
    assert rec["compression"] == ratio_for_bytes(100 * per, smollm2.config, start, dtype=smollm2.dtype)


@needs_kvpress
@pytest.mark.real_model
@pytest.mark.slow(60)
def test_ruler_under_a_press_answers_as_kvpress_own_pipeline(smollm2_dir, smollm2, smollm2_tok, prompt, tmp_path,
                                                             monkeypatch):
    """RULER's niah_single_1 at 1k with snapkv at ratio 0.5 (eval's RULER path: lm-eval's own prompts, each split
    before its last line): the answer is kvpress's own pipeline's on the same context and question ids, and the
    cache after the context holds half a full cache's bytes (up to kvpress's floor)."""
    from hf_kernel_attn.evaluation.families.ruler import question_start, ruler_task_manager, run_ruler

    (tmp_path / "nltk" / "tokenizers" / "punkt_tab").mkdir(parents=True)
    monkeypatch.setenv("NLTK_DATA", str(tmp_path / "nltk"))
    pipe, ratio = prompt[0], 0.5
    with press_runner(smollm2, "snapkv", ratio) as run:
        score = run_ruler(smollm2, smollm2_tok, "niah_single_1", 1024, 1, press=run)
    random.seed(0)  # as lm-eval's simple_evaluate seeds before it builds the prompts (some come from these states)
    numpy.random.seed(1234)
    task = ruler_task_manager(smollm2_dir, 1024).load_task_or_group(["niah_single_1"])["niah_single_1"]
    task.build_all_requests(limit=1, rank=0, world_size=1)
    ids = smollm2_tok(task.instances[0].args[0], add_special_tokens=False)["input_ids"]
    start = question_start(ids, smollm2_tok)
    expected = pipe.forward({"context_ids": torch.tensor([ids[:start]]),
                             "questions_ids": [torch.tensor([ids[start:]])]},
                            press=make_press("snapkv", ratio), max_new_tokens=128)[0]
    assert score.answers[0].strip() == expected.strip()
    per = kv_bytes_per_token(smollm2.config, smollm2.dtype)
    assert score.cost["cache_bytes"] == int(start * (1 - ratio)) * per and score.cost["press"] == "snapkv"
