"""Evaluation tasks: token-stream perplexity, GLUE, zero-shot STS-B embeddings (run here), and the
zero-shot multiple-choice / cloze tasks run through lm-evaluation-harness (:mod:`.lm_eval_tasks`).

Local data follows ``shared/data/EVAL_SPLITS.md``: ``--data-dir DIR --split validation`` reads the
development files, ``--split test`` the standard evaluation files of the same format.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from .long_context import TASKS as LONG_TASKS

SPLITS = ("validation", "test")
TINYSHAKESPEARE_HOLDOUT = 0.05  # `validation` = the last 5% of train.txt (what `finetune` holds out)


@dataclasses.dataclass(frozen=True)
class TextTask:
    """A plain-text perplexity task: local files per split, or a hub dataset."""

    name: str
    files: dict[str, str]
    hub: tuple[str, str | None, str, str]  # (path, config, split, text column)
    holdout_tail: dict[str, float] = dataclasses.field(default_factory=dict)


TEXT_TASKS: dict[str, TextTask] = {
    "wikitext2": TextTask("wikitext2", {"validation": "wikitext-2-raw/wiki.valid.raw",
                                        "test": "wikitext-2-raw/wiki.test.raw"},
                          ("Salesforce/wikitext", "wikitext-2-raw-v1", "{split}", "text")),
    "ptb": TextTask("ptb", {"validation": "ptb/ptb.valid.txt", "test": "ptb/ptb.test.txt"},
                    ("ptb-text-only/ptb_text_only", None, "{split}", "sentence")),
    "tinyshakespeare": TextTask("tinyshakespeare", {"validation": "tinyshakespeare/train.txt",
                                                    "test": "tinyshakespeare/val.txt"},
                                ("karpathy/tiny_shakespeare", None, "{split}", "text"),
                                holdout_tail={"validation": TINYSHAKESPEARE_HOLDOUT}),
}
GLUE_EVAL_TASKS = ("sst2", "mrpc", "rte", "cola", "stsb")
EMBEDDING_TASKS = ("stsb_embedding",)
LM_EVAL_TASKS = ("lambada_openai", "arc_easy", "arc_challenge", "piqa", "boolq", "copa", "openbookqa")
# long-context tasks (evaluation/long_context): one record per (metric, length, depth) cell
LONG_CONTEXT_TASKS = tuple(LONG_TASKS)
NATURAL_TEXT_TASKS = tuple(name for name, t in LONG_TASKS.items() if t.needs_text)  # read wikitext2's file
ALL_TASKS = (*TEXT_TASKS, *LM_EVAL_TASKS, *GLUE_EVAL_TASKS, *EMBEDDING_TASKS, *LONG_CONTEXT_TASKS)


def check_tasks(tasks: list[str]) -> None:
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available tasks: {list(ALL_TASKS)}")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")


def model_kind(task: str) -> str:
    """Which model head a task needs: causal_lm, sequence_classification or embedding."""
    if task in TEXT_TASKS or task in LM_EVAL_TASKS or task in LONG_CONTEXT_TASKS:
        return "causal_lm"
    if task in GLUE_EVAL_TASKS:
        return "sequence_classification"
    return "embedding"


def read_text_task(task: str, split: str, data_dir: str | os.PathLike | None) -> str:
    """The evaluation text of a perplexity task (one stream)."""
    check_split(split)
    spec = TEXT_TASKS[task]
    if data_dir is None:
        import datasets

        path, config, hub_split, column = spec.hub
        try:
            rows = datasets.load_dataset(path, config, split=hub_split.format(split=split))[column]
        except Exception as exc:
            raise RuntimeError(f"cannot read {task} ({path}) from the hub: {exc}; pass --data-dir") from exc
        return "\n".join(rows)
    path = Path(data_dir) / spec.files[split]
    if not path.is_file():
        raise FileNotFoundError(f"{task} --split {split}: expected the file {str(path)!r} (see EVAL_SPLITS.md)")
    from ..data.files import read_text_file

    text = read_text_file(path, f"{task} --split {split} data file")
    tail = spec.holdout_tail.get(split)
    text = text[len(text) - int(len(text) * tail):] if tail else text
    if not text.strip():
        raise ValueError(f"{task} --split {split}: the text read from {str(path)!r} is empty "
                         f"({len(text)} characters, no tokens to score)")
    return text


def expected_files(task: str, split: str) -> list[str]:
    """The local files (relative to ``--data-dir``) that ``task`` reads for ``split`` (EVAL_SPLITS.md)."""
    check_tasks([task])
    check_split(split)
    if task in TEXT_TASKS:
        return [TEXT_TASKS[task].files[split]]
    if task in LONG_CONTEXT_TASKS:
        return [TEXT_TASKS["wikitext2"].files[split]] if task in NATURAL_TEXT_TASKS else []
    if task in LM_EVAL_TASKS:
        from .lm_eval_tasks import _LOCAL

        return list(_LOCAL[task][1][split])
    from ..data import GLUE_TASKS

    glue = GLUE_TASKS["stsb" if task in EMBEDDING_TASKS else task]
    name = glue.eval_file if split == "test" or glue.train_file is None else glue.train_file
    return [f"{glue.name}/{name}"]


def check_data_files(tasks: list[str], split: str, data_dir: str | os.PathLike) -> None:
    """FileNotFoundError listing every missing file and what each task expects, before any model is loaded."""
    problems = []
    for task in tasks:
        files = expected_files(task, split)
        missing = [f for f in files if not (Path(data_dir) / f).is_file()]
        if missing:
            problems.append(f"{task} --split {split} expects {files}, missing {missing}")
    if problems:
        raise FileNotFoundError(f"data files not found under --data-dir {str(data_dir)!r}: " + "; ".join(problems)
                                + " (layout: EVAL_SPLITS.md)")


def accuracy_stderr(correct: list[bool]) -> float:
    """Standard error of the mean of 0/1 outcomes, sqrt(p(1-p)/(n-1)) (lm-eval's mean_stderr)."""
    n = len(correct)
    if n < 2:
        return float("nan")
    p = sum(correct) / n
    return math.sqrt(p * (1 - p) / (n - 1))


def glue_metrics(task: str, preds: list[Any], gold: list[Any]) -> dict[str, tuple[float, float | None]]:
    """GLUE metrics ×100 through the shipped ``evaluate`` modules: {metric: (value, stderr)}."""
    from .metrics import load_metric

    if task == "stsb":
        pear = load_metric("pearsonr").compute(predictions=preds, references=gold)["pearsonr"]
        spear = load_metric("spearmanr").compute(predictions=preds, references=gold)["spearmanr"]
        return {"pearson": (100 * pear, None), "spearman": (100 * spear, None)}
    out: dict[str, tuple[float, float | None]] = {}
    acc = load_metric("accuracy").compute(predictions=preds, references=gold)["accuracy"]
    acc_se = accuracy_stderr([p == g for p, g in zip(preds, gold, strict=True)])
    if task == "cola":
        mcc = load_metric("matthews_correlation").compute(predictions=preds, references=gold)
        return {"matthews_correlation": (100 * mcc["matthews_correlation"], None)}
    if task == "mrpc":
        out["f1"] = (100 * load_metric("f1").compute(predictions=preds, references=gold)["f1"], None)
    out["accuracy"] = (100 * acc, 100 * acc_se)
    return out
