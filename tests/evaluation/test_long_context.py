"""Long-context tasks: the prompt generators are checked on the real SmolLM2 tokenizer by locating the
needle independently (a token-subsequence search and a text search), scoring against hand-made strings,
teacher-forced scoring against real greedy generation, position_loss against transformers' own loss, and
the whole task on SmolLM2 (the original finds a passkey; a window shorter than the distance does not)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from hf_kernel_attn.evaluation.long_context import TASKS
from hf_kernel_attn.evaluation.long_context.base import exact_match, first_number, needle_index, rng_for
from hf_kernel_attn.evaluation.long_context.kv_recall import ASK as KV_ASK
from hf_kernel_attn.evaluation.long_context.niah import NEEDLE as NIAH_NEEDLE
from hf_kernel_attn.evaluation.long_context.niah import QUESTION as NIAH_QUESTION
from hf_kernel_attn.evaluation.long_context.passkey import FILLER, NEEDLE
from hf_kernel_attn.evaluation.long_context.passkey import QUESTION as PASSKEY_QUESTION
from hf_kernel_attn.evaluation.long_context.position_loss import buckets
from hf_kernel_attn.evaluation.long_context.runner import (
    LongContextGrid,
    TokenizedText,
    _teacher_scores,
    bos_ids,
    check_long_context_args,
    run_long_context,
)
from tests.compat import needs_state_cache
from tests.paths import DATA as DATA_DIR
from tests.paths import REPO

DATA = str(DATA_DIR)


def find_sub(seq: list[int], sub: list[int]) -> list[int]:
    """Every index where ``sub`` occurs in ``seq`` (brute force)."""
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub]


@pytest.fixture(scope="module")
def encode(smollm2_tok):
    return lambda text: smollm2_tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def wiki(smollm2_tok):
    from hf_kernel_attn.evaluation.tasks import read_text_task

    return TokenizedText(smollm2_tok, read_text_task("wikitext2", "validation", DATA)[:200_000])


def test_scoring_is_exact_match_of_the_first_number():
    assert first_number(" 71432. Remember") == "71432"
    assert exact_match(first_number(" 71432."), "71432")
    assert not exact_match(first_number(" 714325"), "71432")  # a longer number is not the key
    assert not exact_match(first_number(" 7143 2"), "71432")
    assert not exact_match(first_number(" the key"), "71432")
    assert first_number("is: 1234567 and 89") == "1234567"


def test_random_streams_are_deterministic_and_distinct():
    a = [rng_for(0, "passkey", 512, 50, i).random() for i in range(3)]
    assert a == [rng_for(0, "passkey", 512, 50, i).random() for i in range(3)]
    assert a != [rng_for(1, "passkey", 512, 50, i).random() for i in range(3)]
    assert len(set(a)) == 3


@pytest.mark.parametrize("length", [256, 1024])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_passkey_needle_sits_at_its_depth(encode, smollm2_tok, length, depth):
    sentence = max(len(encode(s)) for s in FILLER)
    for s in TASKS["passkey"].samples(encode, length, depth, 2, seed=3):
        assert len(s.ids) == length
        key = s.answers[0]
        assert len(key) == 5 and key.isdigit()
        needle = encode(NEEDLE.format(key=key))
        where = find_sub(s.ids, needle)
        assert len(where) == 1
        hay0, hay = s.extra["haystack_start"], s.extra["haystack_tokens"]
        target = hay0 + depth / 100 * hay  # depth % of the haystack before the needle
        assert abs(where[0] - target) <= sentence
        assert where[0] == s.needle_start
        text = smollm2_tok.decode(s.ids)
        assert text.count(key) == 2 and text.rstrip().endswith("The pass key is")
        # the prompt is what tokenising its text gives: the pieces join at word boundaries
        assert encode(text) == s.ids


def test_passkey_depth_in_characters(encode, smollm2_tok):
    """The same check in text space: the share of haystack characters before the key."""
    for depth in (0, 50, 100):
        s = TASKS["passkey"].samples(encode, 2048, depth, 1, seed=0)[0]
        text = smollm2_tok.decode(s.ids)
        start = text.index("The grass")
        end = text.rindex("What is the pass key?")
        at = text.index(f"The pass key is {s.answers[0]}")
        haystack_chars = end - start - len(NEEDLE.format(key=s.answers[0]))
        assert abs((at - start) / haystack_chars * 100 - depth) < 1.5


def test_passkey_depth_is_validated(encode):
    with pytest.raises(ValueError, match="depth must be a percentage"):
        needle_index(101, 10, [0, 10])
    with pytest.raises(ValueError, match="cannot hold its fixed parts"):
        TASKS["passkey"].samples(encode, 40, 50, 1, seed=0)


def test_niah_reads_its_sentence_starts_from_the_tokenized_text(encode, wiki):
    """The filler is a sequence of token ids (what position_loss reads) that knows its sentence starts; niah refuses
    bare ids, which do not."""
    assert len(wiki) == len(wiki.ids) and wiki[5] == wiki.ids[5] and wiki[10:20] == wiki.ids[10:20]
    assert list(wiki[:3]) == wiki.ids[:3] and any(wiki.is_boundary(i) for i in range(1, 2000))
    with pytest.raises(ValueError, match="niah needs natural filler text"):
        TASKS["niah"].samples(encode, 1024, 50, 1, seed=0, text_ids=wiki.ids)


@pytest.mark.parametrize("metric", ["exact_match", "exact_match_multikey"])
@pytest.mark.parametrize("depth", [0, 50, 100])
def test_niah_needles(encode, smollm2_tok, wiki, metric, depth):
    cells = TASKS["niah"].samples(encode, 1024, depth, 3, seed=1, metric=metric, text_ids=wiki)
    for s in cells:
        assert len(s.ids) == 1024
        text = smollm2_tok.decode(s.ids)
        key, value = s.extra["key"], s.answers[0]
        needle = encode(NIAH_NEEDLE.format(key=key, value=value))
        where = find_sub(s.ids, needle)
        assert where == [s.needle_start]
        needles = text.count("One of the special magic numbers for")
        assert needles == (4 if metric == "exact_match_multikey" else 1)
        assert text.count(value) == 1 and text.rstrip().endswith(f"The special magic number for {key} mentioned in "
                                                                 "the provided text is")
        target = s.extra["haystack_start"] + depth / 100 * s.extra["haystack_tokens"]
        before = sum(len(encode(NIAH_NEEDLE.format(key="x", value="1234567"))) for _ in range(3))
        # within one WikiText sentence (plus any distractor needles before it) of the target
        assert abs(s.needle_start - target) <= 120 + before


def test_kv_recall_spans_hold_the_answers(encode, smollm2_tok):
    for depth in (0, 50, 100):
        for s in TASKS["kv_recall"].samples(encode, 512, depth, 2, seed=0):
            assert len(s.ids) == 512
            for (a, b), value in zip(s.extra["answer_spans"], s.answers, strict=True):
                assert smollm2_tok.decode(s.ids[a:b]) == f" {value}\n"
            pairs = s.extra["pairs"]
            assert s.extra["asked"][0] == round(depth / 100 * (pairs - 1))
            # the asked key's pair starts at needle_start
            text = smollm2_tok.decode(s.ids[s.needle_start:])
            asked_key = smollm2_tok.decode(s.ids[s.extra["answer_spans"][0][0] - 6:s.extra["answer_spans"][0][0]])
            assert text.startswith("\n" + asked_key.strip().rstrip(":") + ": " + s.answers[0])


@pytest.mark.parametrize("task", ["passkey", "niah", "kv_recall"])
def test_question_start_is_where_the_question_starts(task, encode, smollm2_tok, wiki):
    """``question_start`` splits each prompt into the context (what a KV-cache press compresses) and the question:
    decoded, the rest is the task's question, and no question token is in the context."""
    kwargs = {"text_ids": wiki} if task == "niah" else {}
    for depth in (0, 100):
        for s in TASKS[task].samples(encode, 512, depth, 2, seed=3, **kwargs):
            start = s.question_start
            assert s.needle_start < start < len(s.ids)
            question, context = smollm2_tok.decode(s.ids[start:]), smollm2_tok.decode(s.ids[:start])
            if task == "passkey":
                assert question == PASSKEY_QUESTION and "What is the pass key" not in context
            elif task == "niah":
                assert question == NIAH_QUESTION.format(key=s.extra["key"]) and "What is the special" not in context
            else:  # the list of pairs, then the questions (whose answers are scored teacher-forced after start)
                assert question.startswith(KV_ASK) and start < min(a for a, _ in s.extra["answer_spans"])
                assert re.search(r"\n\d{4}: \w+$", context) and KV_ASK.strip() not in context
    assert TASKS["position_loss"].samples(encode, 64, 0, 1, 0, text_ids=wiki.ids)[0].question_start is None


def test_teacher_forced_scores_equal_greedy_generation(smollm2, smollm2_tok, encode):
    """A query is scored correct iff greedy generation from the prompt before it reproduces its tokens."""
    s = TASKS["kv_recall"].samples(encode, 256, 50, 1, seed=0)[0]
    a, b = s.extra["answer_spans"][0]
    prompt = torch.tensor([s.ids[:a]])
    with torch.no_grad():
        gen = smollm2.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=b - a,
                               do_sample=False, pad_token_id=smollm2_tok.eos_token_id)[0, a:].tolist()
    own = type(s)(s.ids[:a] + gen, ["?"], s.needle_start, s.length, s.depth, {"answer_spans": [(a, b)]})
    assert _teacher_scores(smollm2, [own]) == [[True]]
    wrong = list(gen)
    wrong[-1] = (wrong[-1] + 1) % smollm2.config.vocab_size
    bad = type(s)(s.ids[:a] + wrong, ["?"], s.needle_start, s.length, s.depth, {"answer_spans": [(a, b)]})
    assert _teacher_scores(smollm2, [bad]) == [[False]]


def test_position_loss_buckets_match_transformers_loss(smollm2, smollm2_tok):
    from hf_kernel_attn.evaluation.tasks import read_text_task

    text = read_text_task("wikitext2", "validation", DATA)[:20_000]
    res = run_long_context(smollm2, smollm2_tok, "position_loss", LongContextGrid([64, 128], [0], 2, 0), text=text)
    assert [(r["position_start"], r["length"]) for r in res] == [(0, 64), (64, 128)]
    seqs = TASKS["position_loss"].samples(lambda t: smollm2_tok(t, add_special_tokens=False).input_ids, 128, 0, 2, 0,
                                          text_ids=TokenizedText(smollm2_tok, text).ids, bos=bos_ids(smollm2_tok))
    with torch.no_grad():
        first, second = [], []
        for s in seqs:
            x = torch.tensor([s.ids])
            first.append(float(smollm2(input_ids=x[:, :64], labels=x[:, :64]).loss))  # targets 1..63
            logits = smollm2(input_ids=x).logits[0]
            second.append(float(torch.nn.functional.cross_entropy(logits[63:127], x[0, 64:128])))
    assert math.isclose(res[0]["value"], sum(first) / 2, rel_tol=1e-4)
    assert math.isclose(res[1]["value"], sum(second) / 2, rel_tol=1e-4)
    assert buckets([512, 128, 2048]) == [(0, 128), (128, 512), (512, 2048)]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="--lengths"):
        check_long_context_args([8], [0], 1, 0)
    with pytest.raises(ValueError, match="--depths"):
        check_long_context_args([512], [120], 1, 0)
    with pytest.raises(ValueError, match="--samples"):
        check_long_context_args([512], [0], 0, 0)


def test_passkey_on_smollm2_and_a_short_window(smollm2, smollm2_tok, fresh):
    """The original finds a key 200 tokens back; softmax over the last 16 tokens cannot, and it finds the key
    again when the window covers the prompt."""
    import hf_kernel_attn

    fresh(smollm2)
    grid = LongContextGrid(lengths=[256], depths=[0], samples=2, seed=0)
    assert run_long_context(smollm2, smollm2_tok, "passkey", grid)[0]["value"] == 100
    hf_kernel_attn.patch(smollm2, kernel="softmax", window=16)
    assert run_long_context(smollm2, smollm2_tok, "passkey", grid)[0]["value"] == 0
    hf_kernel_attn.patch(smollm2, kernel="softmax", window=256)
    assert run_long_context(smollm2, smollm2_tok, "passkey", grid)[0]["value"] == 100


@needs_state_cache
def test_recall_cells_carry_their_decode_cost(smollm2, smollm2_tok, fresh):
    """Every recall cell says what it cost: the decode cache after one prompt and the decode ms/token. Softmax's
    cache is its K/V, layers x 2 x KV heads x length x head_dim x 4 bytes by the config; the delta-rule hybrid's
    is the same at both lengths and smaller."""
    import hf_kernel_attn

    fresh(smollm2)
    grid = LongContextGrid(lengths=[128, 256], depths=[50], samples=2, seed=0)
    cfg = smollm2.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    soft = run_long_context(smollm2, smollm2_tok, "passkey", grid)
    for cell in soft:
        want = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cell["length"] * head_dim * 4
        assert cell["cache_bytes"] == want
        assert cell["decode_ms_per_token"] > 0 and cell["decode_batch"] == 2
    hf_kernel_attn.patch(smollm2, kernel="deltanet", window=16, sinks=2)
    delta = run_long_context(smollm2, smollm2_tok, "passkey", grid)
    assert delta[0]["cache_bytes"] == delta[1]["cache_bytes"] < soft[1]["cache_bytes"]
    assert all(c["decode_ms_per_token"] > 0 for c in delta)


def test_eval_command_writes_length_and_depth(smollm2_dir, tmp_path):
    from hf_kernel_attn.cli import main

    out = tmp_path / "r.jsonl"
    rc = main(["eval", "--model", str(smollm2_dir), "--tasks", "passkey", "--lengths", "128", "--depths", "0", "100",
               "--samples", "1", "--output", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert rc == 0
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [(r["length"], r["depth"]) for r in recs] == [(128, 0), (128, 100)]
    assert all(r["task"] == "passkey" and r["metric"] == "exact_match" and r["n"] == 1 for r in recs)
    assert all(r["cache_bytes"] > 0 and r["decode_batch"] == 1 for r in recs)
    assert (tmp_path / "plots" / "passkey_exact_match.png").is_file()


def test_leaderboard_long_context_columns_and_plots(tmp_path):
    from hf_kernel_attn.leaderboard.render import render

    cfg = {"output_dir": str(tmp_path), "split": "validation", "data_dir": DATA, "limit": None,
           "lengths": [512, 1024], "depths": [0, 100],
           "models": [{"name": "m", "kernels": ["softmax", "elu"], "tasks": ["passkey", "position_loss"]},
                      {"name": "m", "kernels": ["softmax"], "tasks": ["niah"], "lengths": [2048]}]}
    recs = []
    values = {("softmax", 512): (100, 50), ("softmax", 1024): (100, 100), ("elu", 512): (0, 100), ("elu", 1024): (0, 0)}
    for (kernel, length), (at0, at100) in values.items():
        for depth, v in ((0, at0), (100, at100)):
            recs.append({"model_name": "m", "kernel_row": kernel, "task": "passkey", "split": "validation",
                         "metric": "exact_match", "value": v, "stderr": 0.0, "n": 3, "length": length, "depth": depth,
                         "kernel": kernel, "params": {}})
        recs.append({"model_name": "m", "kernel_row": kernel, "task": "position_loss", "split": "validation",
                     "metric": "loss", "value": 3.0 + length / 1000, "stderr": None, "n": 2, "length": length,
                     "depth": None, "position_start": 0 if length == 512 else 512, "kernel": kernel, "params": {}})
    recs.append({"model_name": "m", "kernel_row": "softmax", "task": "niah", "split": "validation",
                 "metric": "exact_match", "value": 40.0, "stderr": 0.0, "n": 2, "length": 2048, "depth": 0,
                 "kernel": "softmax", "params": {}})
    table = render(cfg, recs, [])
    assert table["columns"] == ["passkey@512", "passkey@1024", "position_loss@512", "position_loss@1024",
                                "niah@2048"]
    assert table["rows"] == [("m", "softmax"), ("m", "elu")]  # one row from two entries
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| m | softmax | 75 | 100 | 3.512 | 4.024 | 40 |" in md  # the mean over depths
    assert "| m | elu | 50 | 0 |" in md
    assert (tmp_path / "long_context" / "passkey_exact_match.png").stat().st_size > 1000
    assert (tmp_path / "long_context" / "position_loss.png").stat().st_size > 1000


def test_shipped_long_context_profiles_load(tmp_path):
    import yaml

    from hf_kernel_attn.leaderboard.config import load_leaderboard_config

    for name in ("long-context-quick.yaml", "long-context.yaml", "long-context-8k.yaml", "long-context-full.yaml"):
        cfg = load_leaderboard_config((REPO / "configs" / "leaderboard") / name)
        assert all(t in TASKS for m in cfg["models"] for t in m["tasks"])
    bad = yaml.safe_load(((REPO / "configs" / "leaderboard") / "long-context-quick.yaml").read_text())
    bad["depths"] = [0, 150]
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="depths must be percentages"):
        load_leaderboard_config(tmp_path / "b.yaml")


def test_decode_bench_kernel_specs():
    from hf_kernel_attn.speed.decoding import parse_kernel_spec

    assert parse_kernel_spec("softmax:window=64,sinks=4") == ("softmax", {"window": 64, "sinks": 4})
    assert parse_kernel_spec("hedgehog:window=64,window_mix=true") == ("hedgehog", {"window": 64, "window_mix": True})
    assert parse_kernel_spec("elu") == ("elu", {})
    with pytest.raises(ValueError, match="expected name:key=value"):
        parse_kernel_spec("softmax:window")


def _probe_prompts():
    """``probe_prompts`` of docs/long_context/probes/probe_common.py (the probes' helper, outside the package), run
    from its source so that no __pycache__ appears under docs/."""
    path = REPO / "docs" / "long_context" / "probes" / "probe_common.py"
    namespace = {"__name__": "probe_common", "__file__": str(path)}
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
    return namespace["probe_prompts"]


@pytest.mark.parametrize("task", ["passkey", "niah"])
def test_probe_prompts_locate_the_asked_needle_and_its_digits(smollm2_tok, encode, task):
    """The probes' prompt of a cell is the eval's own (seed 0, here its second sample), the span they report is where
    a brute-force search finds the asked needle's tokens, and its digit tokens spell the answer."""
    probe_prompts = _probe_prompts()
    sample, span, digits = probe_prompts(task, smollm2_tok, DATA)(1024, 50, 1)
    if task == "passkey":
        assert sample.ids == TASKS["passkey"].samples(encode, 1024, 50, 2, 0, bos=bos_ids(smollm2_tok))[1].ids
        needle = encode(NEEDLE.format(key=sample.answers[0]))
    else:
        needle = encode(NIAH_NEEDLE.format(key=sample.extra["key"], value=sample.answers[0]))
    assert find_sub(sample.ids, needle) == [span.start] and len(span) == len(needle)
    spelled = "".join(smollm2_tok.decode([sample.ids[i]]).strip() for i in sorted(digits))
    assert spelled == sample.answers[0] * (2 if task == "passkey" else 1)  # the passkey is stated twice
    with pytest.raises(ValueError, match="kv_recall"):
        probe_prompts("kv_recall", smollm2_tok)
