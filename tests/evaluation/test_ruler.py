"""RULER's synthetic tasks (hf_kernel_attn.evaluation.families.ruler) against stock lm-eval on SmolLM2: the project's
run of the original model gives the scores and answers of lm-eval's own ``hf`` model; a saved kernel checkpoint
runs in stock ``lm-eval run --model hf ... trust_remote_code=True`` (no plugin import in the command) and gives the
scores and answers of the project's ``--model hf-kernel-attn``; the question line a press keeps out of the
compressed context is the prompt's last line, on the prompts lm-eval itself builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_kernel_attn
from hf_kernel_attn.evaluation.families.ruler import RULER_TASKS, question_start, ruler_task_manager, run_ruler
from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval

pytestmark = pytest.mark.real_model

LENGTH = 1024
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(autouse=True)
def _no_nltk_download(tmp_path_factory, monkeypatch):
    """lm-eval's RULER module asks nltk for its sentence splitter on import, which tries a download offline: an
    empty punkt_tab folder answers it (the six tasks here never split sentences)."""
    root = tmp_path_factory.getbasetemp() / "nltk_data"
    (root / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("NLTK_DATA", str(root))
    ENV["NLTK_DATA"] = str(root)


def _requests(tasks: list[str], tokenizer_dir: Path, limit: int) -> dict[str, list[str]]:
    """The contexts lm-eval builds for each task (prompt + answer prefix), by lm-eval's own task objects."""
    loaded = ruler_task_manager(tokenizer_dir, LENGTH).load_task_or_group(tasks)
    out = {}
    for task in tasks:
        loaded[task].build_all_requests(limit=limit, rank=0, world_size=1)
        out[task] = [inst.args[0] for inst in loaded[task].instances]
    return out


@pytest.mark.slow(20)
def test_the_question_a_press_keeps_is_the_last_line_of_every_prompt(smollm2_dir, smollm2_tok):
    for task, contexts in _requests(list(RULER_TASKS), smollm2_dir, 2).items():
        for context in contexts:
            ids = smollm2_tok(context, add_special_tokens=False)["input_ids"]
            start = question_start(ids, smollm2_tok)
            last_line = context.rsplit("\n", 1)[1]
            assert smollm2_tok.decode(ids[start:]).strip() == last_line.strip(), task
            assert smollm2_tok.decode(ids[:start]).endswith("\n"), task
            assert len(ids) - start < 128 < start, (task, start, len(ids))  # the question, not the haystack


def test_question_start_needs_a_newline(smollm2_tok):
    ids = smollm2_tok("no newline anywhere in this prompt", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="no newline"):
        question_start(ids, smollm2_tok)


def test_ruler_options_are_checked_before_any_model_loads():
    with pytest.raises(ValueError, match="lengths must be integers >= 256"):
        run_eval(ModelSpec("no/such/model"), ["niah_single_1"], EvalSettings(lengths=[100]))


@pytest.mark.slow(120)
def test_the_project_scores_the_original_model_as_stock_lm_eval(smollm2_dir, smollm2, smollm2_tok):
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for task in ("niah_single_1", "ruler_vt"):
        # one task per run, as the project runs them: RULER draws some of its prompts from Python's global random
        # state, which a task generated before it in the same run has moved on
        # (lm-eval's ruler folder only indexed, which saves the half minute indexing every built-in task costs)
        manager = TaskManager(include_path=str(Path(lm_eval.__file__).parent / "tasks" / "ruler"),
                              include_defaults=False, metadata={"tokenizer": str(smollm2_dir),
                                                                "max_seq_lengths": [LENGTH]})
        stock = simple_evaluate(model="hf", model_args=f"pretrained={smollm2_dir}", tasks=[task], limit=2,
                                batch_size=1, device="cpu", task_manager=manager, log_samples=True, bootstrap_iters=0)
        ours = run_ruler(smollm2, smollm2_tok, task, LENGTH, 2)
        expected = [s["filtered_resps"][0] for s in sorted(stock["samples"][task], key=lambda s: s["doc_id"])]
        assert ours.answers == expected, task
        assert ours.value == pytest.approx(100 * stock["results"][task][f"{LENGTH},none"]), task
        assert ours.n == 2 and ours.cost["cache_bytes"] > 0


def _run_cli(argv: list[str], out: Path) -> tuple[dict, list[str]]:
    proc = subprocess.run([*argv, "--output_path", str(out), "--log_samples"], capture_output=True, text=True,
                          env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"]["niah_single_1"]
    rows = [json.loads(ln) for ln in sorted(out.rglob("samples_niah_single_1_*.jsonl"))[-1].read_text().splitlines()]
    return results, [r["filtered_resps"][0] for r in sorted(rows, key=lambda r: r["doc_id"])]


@pytest.mark.slow(110)
def test_stock_lm_eval_runs_a_saved_kernel_checkpoint_like_the_plugins_model_type(smollm2_dir, tmp_path):
    folder = tmp_path / "converted"
    model = hf_kernel_attn.from_pretrained(smollm2_dir, kernel="hedgehog",
                                           kernel_params={"window": 64, "window_mix": True, "sinks": 4})
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, folder)
    common = ["--tasks", "niah_single_1", "--metadata", json.dumps({"max_seq_lengths": [LENGTH]}), "--limit", "2",
              "--batch_size", "1"]
    stock, stock_answers = _run_cli([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                                     f"pretrained={folder},trust_remote_code=True", *common], tmp_path / "stock")
    ours, our_answers = _run_cli([sys.executable, "-m", "hf_kernel_attn.cli", "lm-eval", "run", "--model",
                                  "hf-kernel-attn", "--model_args", f"pretrained={folder}", *common], tmp_path / "ours")
    assert our_answers == stock_answers and len(stock_answers) == 2
    assert ours[f"{LENGTH},none"] == pytest.approx(stock[f"{LENGTH},none"])
