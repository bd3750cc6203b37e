"""``hf-kernel-attn eval``: perplexity against an independent loop on SmolLM2, GLUE and STS-B
embedding scores against scikit-learn/scipy, lm-eval's stock ``hf`` model against ours, errors."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_kernel_attn.evaluation.lm_eval_tasks import _convert, local_task_dir
from hf_kernel_attn.evaluation.runner import RECORD_KEYS, EvalSettings, ModelSpec, run_eval
from hf_kernel_attn.evaluation.task import EvalOptions
from tests.paths import DATA

pytestmark = pytest.mark.real_model


def guide_perplexity(model, ids: torch.Tensor, context: int, stride: int, windows: int) -> float:
    """The transformers perplexity guide's loop, written out independently."""
    nlls, n_tokens, prev_end = [], 0, 0
    for w, begin in enumerate(range(0, ids.numel(), stride)):
        if w == windows:
            break
        end = min(begin + context, ids.numel())
        trg_len = end - prev_end
        input_ids = ids[begin:end][None]
        target = input_ids.clone()
        target[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target).loss
        valid = int((target[:, 1:] != -100).sum())
        nlls.append(loss * valid)
        n_tokens += valid
        prev_end = end
        if end == ids.numel():
            break
    return math.exp(float(torch.stack(nlls).sum()) / n_tokens)


@pytest.mark.parametrize("stride", [128, 64])
def test_wikitext2_perplexity_matches_the_guide(smollm2_dir, smollm2, stride, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "r.jsonl"
    records = run_eval(ModelSpec(str(smollm2_dir)), ["wikitext2"],
                       EvalSettings(data_dir=DATA, limit=3, context=128, stride=stride, output=out))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = (DATA / "wikitext-2-raw" / "wiki.valid.raw").read_text()
    ids = torch.tensor(tok(text[:20000], add_special_tokens=False)["input_ids"])
    expected = guide_perplexity(smollm2, ids, 128, stride, 3)
    ppl = next(r for r in records if r["metric"] == "perplexity")
    assert ppl["value"] == pytest.approx(expected, rel=5e-3)
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert lines == records and all(tuple(r) == RECORD_KEYS for r in lines)
    assert {r["metric"] for r in lines} == {"perplexity", "bits_per_byte"}
    assert lines[0]["kernel"] == "softmax" and lines[0]["split"] == "validation"


def test_patched_kernel_changes_perplexity(smollm2_dir):
    base = run_eval(ModelSpec(str(smollm2_dir)), ["wikitext2"], EvalSettings(data_dir=DATA, limit=2, context=64))
    elu = run_eval(ModelSpec(str(smollm2_dir), kernel="elu"), ["wikitext2"],
                   EvalSettings(data_dir=DATA, limit=2, context=64))
    assert elu[0]["kernel"] == "elu" and elu[0]["value"] > 2 * base[0]["value"]


def test_stsb_embedding_matches_independent_computation(minilm_dir, minilm, minilm_tok):
    from scipy.stats import spearmanr

    from hf_kernel_attn.data import load_glue

    rec = run_eval(ModelSpec(str(minilm_dir)), ["stsb_embedding"], EvalSettings(data_dir=DATA, limit=60))[0]
    rows = load_glue("stsb", "validation", DATA)[:60]

    def emb(texts):
        enc = minilm_tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = minilm(**enc).last_hidden_state
        m = enc["attention_mask"][..., None].float()
        return (h * m).sum(1) / m.sum(1)

    a, b = emb([r.text_a for r in rows]), emb([r.text_b for r in rows])
    expected = 100 * spearmanr(torch.cosine_similarity(a, b).tolist(), [r.label for r in rows]).statistic
    assert rec["metric"] == "spearman" and rec["n"] == 60
    assert rec["value"] == pytest.approx(expected, abs=1e-6)


def test_glue_metrics_match_sklearn(tmp_path, minilm_dir):
    """A classification head on MiniLM (random head, fixed seed): eval's numbers equal sklearn's on the
    model's own predictions, computed here independently; the test split reads the eval file name."""
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    model.save_pretrained(tmp_path / "clf")
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(tmp_path / "clf")
    (tmp_path / "data" / "mrpc").mkdir(parents=True)
    src = (DATA / "mrpc" / "train.tsv").read_text(encoding="utf-8-sig").splitlines()
    (tmp_path / "data" / "mrpc" / "dev.tsv").write_text("\n".join(src[:41]) + "\n", encoding="utf-8")
    recs = run_eval(ModelSpec(str(tmp_path / "clf")), ["mrpc"], EvalSettings(split="test", data_dir=tmp_path / "data"))
    got = {r["metric"]: r["value"] for r in recs}
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    rows = [ln.split("\t") for ln in src[1:41]]
    enc = tok([r[3] for r in rows], [r[4] for r in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        preds = model.eval()(**enc).logits.argmax(-1).tolist()
    gold = [int(r[0]) for r in rows]
    assert got["accuracy"] == pytest.approx(100 * accuracy_score(gold, preds))
    assert got["f1"] == pytest.approx(100 * f1_score(gold, preds))
    assert all(r["n"] == 40 for r in recs)


def test_local_lm_eval_rows_follow_the_stock_layout():
    arc = _convert("arc", [DATA / "arc" / "ARC-Easy-Dev.jsonl"])[0]
    raw = json.loads((DATA / "arc" / "ARC-Easy-Dev.jsonl").read_text().splitlines()[0])
    assert arc["question"] == raw["question"]["stem"] and arc["answerKey"] == raw["answerKey"]
    assert arc["choices"]["text"] == [c["text"] for c in raw["question"]["choices"]]
    obqa = _convert("openbookqa", [DATA / "openbookqa" / "dev.tsv"])[0]
    assert obqa["choices"] == {"text": ["Deep sea animals", "fish", "Long Sea Fish", "Far Sea Animals"],
                               "label": ["A", "B", "C", "D"]}
    assert obqa["answerKey"] == "A" and obqa["question_stem"].startswith("Frilled sharks")
    lamb = _convert("lambada", [DATA / "lambada" / "lambada_development_plain_text.txt"])
    assert len(lamb) == 4869


def _piqa_fixture(root: Path) -> Path:
    """piqa's evaluation files in the EVAL_SPLITS layout: the first rows of the unlabeled file with
    labels (only the format matters here: both model types score the same rows)."""
    (root / "piqa").mkdir(parents=True, exist_ok=True)
    rows = (DATA / "piqa" / "tests.unlabeled.jsonl").read_text().splitlines()[:8]
    (root / "piqa" / "valid.jsonl").write_text("\n".join(rows) + "\n")
    (root / "piqa" / "valid-labels.lst").write_text("\n".join(str(i % 2) for i in range(8)) + "\n")
    for sub in ("arc", "lambada"):
        (root / sub).symlink_to(DATA / sub)
    return root


def _lm_eval(args: list[str], out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "hf_kernel_attn.cli", "lm-eval", *args, "--output_path", str(out)],
                          capture_output=True, text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted(out.rglob("results_*.json"))
    assert found, proc.stdout[-2000:]
    return json.loads(found[-1].read_text())["results"]


@pytest.mark.slow(26)
def test_our_lm_eval_model_equals_stock_hf(smollm2_dir, tmp_path):
    """`--model hf-kernel-attn kernel=softmax` and lm-eval's stock `--model hf` on the same local tasks."""
    data = _piqa_fixture(tmp_path / "data")
    tasks = local_task_dir(["arc_easy", "piqa", "lambada_openai"], data, "validation", tmp_path / "tasks")
    common = ["--tasks", "arc_easy,piqa,lambada_openai", "--include_path", str(tasks), "--limit", "2",
              "--batch_size", "1"]
    ours = _lm_eval(["--model", "hf-kernel-attn", "--model_args", f"pretrained={smollm2_dir},kernel=softmax",
                     *common], tmp_path / "ours")
    # the reference: lm-eval's own `hf` model through its Python API (only the local tasks indexed, which saves
    # the half minute a second command line spends indexing every built-in task)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    stock = simple_evaluate(model="hf", model_args=f"pretrained={smollm2_dir}",
                            tasks=["arc_easy", "piqa", "lambada_openai"], limit=2, batch_size=1, device="cpu",
                            task_manager=TaskManager(include_path=str(tasks), include_defaults=False))["results"]
    for task in ("arc_easy", "piqa", "lambada_openai"):
        for key, value in stock[task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert ours[task][key] == pytest.approx(value, abs=1e-3), (task, key)
    assert "acc,none" in stock["lambada_openai"] and "perplexity,none" in stock["lambada_openai"]


def test_eval_settings_carry_every_task_option():
    """The settings of `run_eval` are the tasks' options plus where the records and plots go and the KV-cache
    press (run_eval runs it, the tasks do not read it)."""
    settings = {f.name for f in dataclasses.fields(EvalSettings)}
    assert settings - {f.name for f in dataclasses.fields(EvalOptions)} == {
        "output", "plot_dir", "press", "compression", "press_bytes"}
    assert EvalSettings().task_options() == EvalOptions()
    assert EvalSettings(limit=3, seed=7, output="r.jsonl").task_options() == EvalOptions(limit=3, seed=7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EvalSettings().limit = 3


def test_eval_errors(smollm2_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        run_eval(ModelSpec(str(smollm2_dir)), ["wikitext3"], EvalSettings(data_dir=DATA))
    with pytest.raises(ValueError, match="unknown split"):
        run_eval(ModelSpec(str(smollm2_dir)), ["wikitext2"], EvalSettings(split="dev", data_dir=DATA))
    with pytest.raises(FileNotFoundError, match="wiki.test.raw"):
        run_eval(ModelSpec(str(smollm2_dir)), ["wikitext2"], EvalSettings(split="test", data_dir=DATA))
    with pytest.raises(FileNotFoundError, match="ARC-Easy-Test.jsonl"):
        local_task_dir(["arc_easy"], DATA, "test", tmp_path)
    with pytest.raises(ValueError, match="need --kernel"):
        run_eval(ModelSpec(str(smollm2_dir), layers=[0]), ["wikitext2"], EvalSettings(data_dir=DATA))
    proc = subprocess.run([sys.executable, "-m", "hf_kernel_attn.cli", "eval", "--model", str(smollm2_dir),
                           "--tasks", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "available tasks" in proc.stderr


def test_missing_local_model_folder_is_named(tmp_path):
    """A local folder that does not exist is reported as such, not as a malformed hub repo id; hub ids pass."""
    from hf_kernel_attn.evaluation.runner import ModelSpec, check_model_path

    missing = str(tmp_path / "outputs" / "run" / "final")
    with pytest.raises(FileNotFoundError, match="model folder .*final.* does not exist"):
        ModelSpec(missing).load("causal_lm")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_path("outputs/no-such-run-here/final")
    check_model_path("HuggingFaceTB/SmolLM2-135M")  # a hub id: left to transformers
    check_model_path("gpt2")
