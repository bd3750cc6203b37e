"""Evaluation tasks as objects: the contract every registered task keeps (a model kind, a main metric, the files
of each split it supports), the old names as live views of the registry, the errors, and a task of one's own
(tests/custom_eval_task.py) in ``eval`` (through ``--import``) and in a leaderboard (through ``imports:``)."""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_kernel_attn.evaluation.task import MODEL_CLASSES, RECORD_KEYS, lower_is_better, main_metric
from hf_kernel_attn.evaluation.tasks import (
    ALL_TASKS,
    EVAL_TASKS,
    LONG_CONTEXT_TASKS,
    RULER_TASKS,
    EvalTask,
    check_tasks,
    expected_files,
    model_kind,
    register_eval_task,
)
from hf_kernel_attn.leaderboard.render import MAIN_METRIC
from tests.paths import REPO

ROOT = REPO
CUSTOM = "tests.custom_eval_task"
LINES = ["The cat sat on the mat.", "A dog barked at the moon last night.", "Rain fell over the quiet town.",
         "She opened the window and looked outside."]

# the main metrics the leaderboard showed before tasks were objects (sweep.MAIN_METRIC's old table)
OLD_MAIN_METRIC = {
    "wikitext2": "perplexity", "ptb": "perplexity", "tinyshakespeare": "perplexity", "lambada_openai": "acc",
    "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "piqa": "acc_norm", "boolq": "acc", "copa": "acc",
    "openbookqa": "acc_norm", "sst2": "accuracy", "mrpc": "f1", "rte": "accuracy", "cola": "matthews_correlation",
    "stsb": "spearman", "stsb_embedding": "spearman", "passkey": "exact_match", "niah": "exact_match",
    "kv_recall": "exact_match", "position_loss": "loss",
    # RULER's offline tasks through lm-eval: its string-match score, percent
    "niah_single_1": "score", "niah_multikey_2": "score", "niah_multikey_3": "score", "ruler_vt": "score",
    "ruler_cwe": "score", "ruler_fwe": "score",
}


@pytest.fixture
def custom_task():
    """tests/custom_eval_task.py is imported by the test (``--import`` / ``imports:``) and forgotten after it."""
    assert "line_loss" not in EVAL_TASKS
    yield CUSTOM
    EVAL_TASKS.pop("line_loss", None)
    sys.modules.pop(CUSTOM, None)


def _lines_dir(root: Path) -> Path:
    (root / "lines").mkdir(parents=True)
    (root / "lines" / "validation.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return root


# ------------------------------------------------------------------------------------------------ contract


@pytest.mark.parametrize("name", list(OLD_MAIN_METRIC))
def test_every_task_has_a_kind_a_main_metric_and_files_for_each_split(name):
    task = EVAL_TASKS.get(name)
    assert isinstance(task, EvalTask) and task.name == name
    assert task.model_kind in MODEL_CLASSES and model_kind(name) == task.model_kind
    assert task.main_metric == main_metric(name) == MAIN_METRIC[name] == OLD_MAIN_METRIC[name]
    assert lower_is_better(name, task.main_metric) is (task.main_metric in ("perplexity", "loss"))
    assert task.splits == ("validation", "test")
    for split in task.splits:
        files = task.files(split)
        assert isinstance(files, list) and all(isinstance(f, str) and f for f in files)
        assert expected_files(name, split) == files
    assert task.by_length is (name in LONG_CONTEXT_TASKS or name in RULER_TASKS)


def test_the_registry_holds_exactly_the_built_in_tasks_in_order():
    assert list(ALL_TASKS) == list(OLD_MAIN_METRIC) == list(EVAL_TASKS)
    assert dict(MAIN_METRIC) == OLD_MAIN_METRIC


def test_old_names_are_live_views_of_the_registry():
    """A task registered later is in ALL_TASKS and MAIN_METRIC (and in the unknown-task message), gone after."""

    class Probe(EvalTask):
        name = "registry_probe"
        model_kind = "embedding"
        main_metric = "probe_score"

        def files(self, split):
            return []

    register_eval_task(Probe)
    try:
        assert "registry_probe" in ALL_TASKS and ALL_TASKS[-1] == "registry_probe"
        assert MAIN_METRIC["registry_probe"] == "probe_score" and model_kind("registry_probe") == "embedding"
        with pytest.raises(ValueError, match="registry_probe"):
            check_tasks(["nope"])
    finally:
        EVAL_TASKS.pop("registry_probe")
    assert "registry_probe" not in ALL_TASKS and "registry_probe" not in MAIN_METRIC


def test_unknown_task_is_named_with_the_valid_tasks():
    with pytest.raises(ValueError) as err:
        check_tasks(["wikitext2", "wikitext3", "arc"])
    msg = str(err.value)
    assert "unknown task(s) ['wikitext3', 'arc']" in msg and str(list(ALL_TASKS)) in msg and "--import" in msg
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['nope'\]"):
        expected_files("nope", "validation")
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        expected_files("wikitext2", "dev")


def test_lm_eval_tasks_carry_their_stock_task_files_and_converter():
    """lm-eval's local copies come from the task objects: every LmEvalTask names a stock YAML and a converter, and
    `lm-eval --data-dir` / local_rows refuse a task that is not one, listing those that are."""
    from hf_kernel_attn.evaluation.families.lm_eval import CONVERTERS, LmEvalTask
    from hf_kernel_attn.evaluation.lm_eval_tasks import local_rows, local_task_args

    tasks = [t for _, t in EVAL_TASKS.items() if isinstance(t, LmEvalTask)]
    assert [t.name for t in tasks] == ["lambada_openai", "arc_easy", "arc_challenge", "piqa", "boolq", "copa",
                                       "openbookqa"]
    assert all(t.stock.endswith(".yaml") and t.convert in CONVERTERS.values() for t in tasks)
    names = str(sorted(t.name for t in tasks))
    with pytest.raises(ValueError, match=rf"no local lm-eval config for 'wikitext2'; available: {re.escape(names)}"):
        local_rows("wikitext2", ROOT, "validation")
    with pytest.raises(ValueError, match=r"no local files for task\(s\) \['wikitext2'\]"):
        local_task_args(["--tasks", "arc_easy,wikitext2", "--data-dir", str(ROOT)], ROOT)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"name": ""}, "needs a name"),
        ({"name": "a@b"}, "without '@'"),
        ({"model_kind": "seq2seq"}, "model_kind must be one of ['causal_lm', 'sequence_classification', 'embedding']"),
        ({"main_metric": None}, "main_metric must be"),
        ({"splits": ("train",)}, "splits must be among ['validation', 'test']"),
    ],
)
def test_a_task_that_cannot_work_is_refused(attrs, message):
    base = {"name": "bad_probe", "model_kind": "causal_lm", "main_metric": "m", "files": lambda self, split: []}
    cls = type("Bad", (EvalTask,), {**base, **attrs})
    with pytest.raises(ValueError) as err:
        register_eval_task(cls)
    assert message in str(err.value)
    assert "bad_probe" not in EVAL_TASKS
    with pytest.raises(TypeError, match="EvalTask"):
        register_eval_task(object())


def test_another_task_under_a_taken_name_is_refused():
    class Clash(EvalTask):
        name = "wikitext2"
        model_kind = "causal_lm"
        main_metric = "perplexity"

    with pytest.raises(ValueError, match="evaluation task 'wikitext2' is already registered by .*TextTask"):
        register_eval_task(Clash)
    assert type(EVAL_TASKS.get("wikitext2")).__name__ == "TextTask"


def test_the_task_contract_imports_no_torch_and_nothing_is_imported_in_a_cycle():
    code = ("import sys, hf_kernel_attn.evaluation.task as t\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "assert not [m for m in sys.modules if m.startswith('hf_kernel_attn.evaluation.families')]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _import_cycles(ROOT / "hf_kernel_attn") == []


def _import_cycles(package: Path) -> list[list[str]]:
    """Cycles among the package's module-level imports (a module importing its own parent package excepted)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if isinstance(n, ast.Import):
                    deps |= {a.name for a in n.names}
                elif isinstance(n, ast.ImportFrom):
                    base = mod.split(".")[: None if is_pkg else -1]
                    base = base[: len(base) - n.level + 1] if n.level else []
                    target = ".".join([*base, *(n.module.split(".") if n.module else [])])
                    deps |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in n.names}
        graph[mod] = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 2)
                      if ".".join(d.split(".")[:i]) in modules} - {mod}
        graph[mod] = {d for d in graph[mod] if not mod.startswith(d + ".")}
    cycles, seen = [], set()

    def visit(mod: str, stack: list[str]) -> None:
        if mod in stack:
            cycles.append(stack[stack.index(mod):] + [mod])
            return
        if mod in seen:
            return
        seen.add(mod)
        for dep in sorted(graph[mod]):
            visit(dep, [*stack, mod])

    for mod in sorted(graph):
        visit(mod, [])
    return cycles


# --------------------------------------------------------------------------------------- a task of one's own


def test_a_task_of_ones_own_in_eval(custom_task, tiny_llama, tmp_path, capsys):
    """`eval --import tests.custom_eval_task --tasks line_loss`: the task's records, its numbers equal to an
    independent computation; a missing file is listed as the task expects it; an unknown task lists the custom
    task among the valid ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_kernel_attn.cli import main

    data, out = _lines_dir(tmp_path / "data"), tmp_path / "r.jsonl"
    rc = main(["--import", custom_task, "eval", "--model", str(tiny_llama), "--tasks", "line_loss", "wikitext2",
               "--data-dir", str(data / "missing"), "--output", str(out)])
    assert rc == 2 and "not a folder" in capsys.readouterr().err
    rc = main(["--import", custom_task, "eval", "--model", str(tiny_llama), "--tasks", "line_loss",
               "--data-dir", str(tmp_path), "--output", str(out)])
    assert rc == 2 and "line_loss --split validation expects ['lines/validation.txt']" in capsys.readouterr().err
    rc = main(["--import", custom_task, "eval", "--model", str(tiny_llama), "--tasks", "line_loss", "--limit", "3",
               "--data-dir", str(data), "--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert "mean_nll" in capsys.readouterr().out  # the summary table
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["metric"] for r in recs] == ["perplexity", "mean_nll"]
    assert all(tuple(r) == RECORD_KEYS and r["task"] == "line_loss" and r["kernel"] == "softmax" for r in recs)
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_llama).eval(), AutoTokenizer.from_pretrained(tiny_llama)
    with torch.no_grad():
        losses = [float(model(ids, labels=ids).loss) for ids in (tok(x, return_tensors="pt").input_ids
                                                                   for x in LINES[:3])]
    assert recs[1]["n"] == 3 and recs[1]["value"] == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert math.isfinite(recs[0]["value"]) and recs[0]["value"] > 1
    rc = main(["--import", custom_task, "eval", "--model", str(tiny_llama), "--tasks", "line_los"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown task(s) ['line_los']" in err and "'line_loss'" in err


def test_a_task_of_ones_own_in_the_leaderboard(custom_task, tiny_llama, tmp_path, capsys):
    """A leaderboard whose config imports tests/custom_eval_task.py: the header shows the task's main metric, each
    cell its mean_nll (not the perplexity recorded first), and the heat map reads it as lower-is-better."""
    from hf_kernel_attn.cli import main
    from hf_kernel_attn.leaderboard.plots import heat_grid

    cfg = {"imports": [custom_task], "output_dir": str(tmp_path / "lb"), "data_dir": str(_lines_dir(tmp_path / "d")),
           "limit": 2, "jobs": 1,
           "models": [{"name": "tiny", "model": str(tiny_llama), "kernels": ["softmax", "elu"],
                       "tasks": ["line_loss"]}]}
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["leaderboard", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "tiny softmax line_loss: mean_nll " in out
    md = (tmp_path / "lb" / "leaderboard.md").read_text()
    assert "| model | kernel | line_loss (mean_nll) |" in md and "?" not in md.splitlines()[0]
    recs = [json.loads(ln) for ln in (tmp_path / "lb" / "results.jsonl").read_text().splitlines()]
    nll = {r["kernel_row"]: r["value"] for r in recs if r["metric"] == "mean_nll"}
    assert set(nll) == {"softmax", "elu"}
    for kernel, value in nll.items():
        assert f"| tiny | {kernel} | {value:.4g}" in md
    cell = {("tiny", k, "line_loss"): r for r in recs if r["metric"] == "mean_nll" for k in [r["kernel_row"]]}
    ratios, _ = heat_grid([("tiny", "softmax"), ("tiny", "elu")], ["line_loss"], cell, {})
    assert ratios[1, 0] == pytest.approx(nll["softmax"] / nll["elu"])  # lower is better: inverted
