"""Chance level of a leaderboard cell: the score a model gets by guessing, from the task itself.

A cell is *at chance* when its score is at or below ``chance + 1 standard error``, the standard error being that
of a guesser's score on the same ``n`` items (a one-sided z <= 1: the score cannot be told apart from guessing).
The guesser picks uniformly among the task's possible answers, whatever the input:

* lm-eval multiple-choice tasks (ARC, PIQA, BoolQ, COPA, OpenBookQA): lm-eval's own task definition (its
  ``doc_to_choice``) over the documents it evaluated (``doc_iterator(limit=n)``, the first ``n``): chance is the
  mean of 1/choices (ARC has questions with 3, 4 and 5 choices), its standard error sqrt(sum p(1-p)) / n;
* lm-eval tasks without a choice set (LAMBADA: the greedy continuation must equal the target word out of the
  whole vocabulary) and the long-context retrieval tasks (an exact generated answer): 0, with no spread;
* GLUE classification (``num_labels`` classes of the task definition): accuracy 100/classes, Matthews
  correlation 0 (standard error 100/sqrt(n)), F1 of the positive class simulated against the evaluated labels;
* correlations with a gold score (STS-B Spearman / Pearson, GLUE and embeddings): 0, standard error
  100/sqrt(n - 1) (Spearman's rho under independence);
* a record that carries its own ``chance`` (the synthetic tasks of ``similarity``): that, with the record's
  standard error;
* perplexity, bits per byte and losses have no chance level (None).

Values are on the metric's own scale: lm-eval's in [0, 1], GLUE's and the embedding task's ×100 (as the
evaluation writes them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tempfile
from typing import Any

from ..data import GLUE_TASKS, load_glue
from ..evaluation.lm_eval_tasks import local_task_dir
from ..evaluation.task import LOWER_IS_BETTER, find_task
from ..evaluation.tasks import EmbeddingTask, GlueEvalTask, LmEvalTask, LongContextEvalTask, RulerTask

__all__ = ["LOWER_IS_BETTER", "Chance", "at_chance", "chance_level", "correlation_chance", "multiple_choice_chance"]

NO_CHANCE_METRICS = LOWER_IS_BETTER  # no guessing level
CORRELATIONS = {"spearman", "pearson"}
OPEN_ANSWER_METRICS = {"exact_match"}  # long-context retrieval: the answer is generated, not chosen
TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class Chance:
    """A guesser's expected score (``value``) and the standard error of its score on the cell's items (``se``),
    on the metric's own scale; ``how`` says where it comes from."""

    value: float
    se: float
    how: str

    @property
    def threshold(self) -> float:
        return self.value + self.se


def at_chance(value: float, chance: Chance | None) -> bool:
    """True where ``value`` is at or below chance + 1 standard error (False without a chance level)."""
    if chance is None or value is None or math.isnan(value):
        return False
    return value <= chance.threshold + TOLERANCE


def multiple_choice_chance(choices: list[int], scale: float = 1.0) -> Chance:
    """Uniform guessing among ``choices[i]`` answers on item i: mean of 1/k_i, standard error sqrt(sum p(1-p))/n."""
    if not choices or min(choices) < 1:
        raise ValueError(f"every item needs at least one choice, got {choices!r}")
    p = [1 / k for k in choices]
    n = len(p)
    return Chance(scale * sum(p) / n, scale * math.sqrt(sum(q * (1 - q) for q in p)) / n,
                  f"uniform guess among {_range(choices)} choices, mean 1/choices over {n} items")


def correlation_chance(n: int, scale: float = 100.0) -> Chance:
    """A score uncorrelated with the gold one: 0, standard error 1/sqrt(n - 1)."""
    return Chance(0.0, scale / math.sqrt(max(1, n - 1)), f"uncorrelated: 0, se 1/sqrt(n-1) at n={n}")


def chance_level(task: str, metric: str, n: int | None, *, split: str = "validation",
                 data_dir: str | os.PathLike | None = None, record: dict[str, Any] | None = None) -> Chance | None:
    """The chance level of ``task``'s ``metric`` over its first ``n`` evaluated items; None where it has none
    or it cannot be derived (the task's data cannot be read)."""
    if metric in NO_CHANCE_METRICS:
        return None
    if record is not None and isinstance(record.get("chance"), (int, float)):
        return Chance(float(record["chance"]), float(record.get("stderr") or 0.0),
                      "the record's own chance level, ± its own standard error")
    n = int(n or 0)
    obj = find_task(task)
    if isinstance(obj, LongContextEvalTask):
        return Chance(0.0, 0.0, "an exact generated answer: 0") if metric in OPEN_ANSWER_METRICS else None
    if isinstance(obj, RulerTask):
        return Chance(0.0, 0.0, "generated answers matched as strings: 0")
    if isinstance(obj, EmbeddingTask) or (isinstance(obj, GlueEvalTask) and metric in CORRELATIONS):
        return correlation_chance(n) if metric in CORRELATIONS and n > 1 else None
    if isinstance(obj, GlueEvalTask):
        return _glue_chance(obj.glue, metric, n, split, None if data_dir is None else str(data_dir))
    if isinstance(obj, LmEvalTask) and n > 0:
        try:
            kind, choices = _lm_eval_choices(task, split, None if data_dir is None else str(data_dir), n)
        except Exception:  # lm-eval missing, the data unreadable: no chance level (the cell shows its ratio)
            return None
        if kind != "multiple_choice":
            return Chance(0.0, 0.0, f"lm-eval {kind}: no choice set, 0")
        return multiple_choice_chance(choices)
    return None


@functools.lru_cache(maxsize=64)
def _lm_eval_choices(task: str, split: str, data_dir: str | None, n: int) -> tuple[str, list[int]]:
    """lm-eval's output type of ``task`` and, for multiple choice, the number of choices of each of the ``n``
    documents it evaluates (its ``doc_iterator(limit=n)``), through the same task configs as the evaluation."""
    from lm_eval.tasks import TaskManager, get_task_dict

    with tempfile.TemporaryDirectory() as tmp:
        if data_dir is not None:
            manager = TaskManager(include_path=str(local_task_dir([task], data_dir, split, tmp)),
                                  include_defaults=False)
        else:
            manager = TaskManager()
        obj = get_task_dict([task], task_manager=manager)[task]  # (TaskManager.load is lm-eval >= 0.4.11 only)
        kind = obj.OUTPUT_TYPE
        if kind != "multiple_choice":
            return kind, []
        return kind, [len(obj.doc_to_choice(doc)) for _, doc in obj.doc_iterator(limit=n)]


def _glue_chance(task: str, metric: str, n: int, split: str, data_dir: str | None) -> Chance | None:
    spec = GLUE_TASKS[task]
    k = spec.num_labels
    if n < 1 or spec.is_regression:
        return None
    if metric == "accuracy":
        p = 1 / k
        return Chance(100 * p, 100 * math.sqrt(p * (1 - p) / n), f"uniform guess among {k} labels")
    if metric == "matthews_correlation":  # phi of independent labels: n phi^2 ~ chi2(1), se 1/sqrt(n)
        return Chance(0.0, 100 / math.sqrt(n), f"independent of the labels: 0, se 1/sqrt(n) at n={n}")
    if metric == "f1":
        try:
            gold = _glue_labels(task, split, data_dir)[:n]
        except Exception:
            return None
        return _simulated_f1(gold, k)
    return None


@functools.lru_cache(maxsize=16)
def _glue_labels(task: str, split: str, data_dir: str | None) -> list[int]:
    return [int(r.label) for r in load_glue(task, split, data_dir)]


def _simulated_f1(gold: list[int], classes: int, draws: int = 2000, seed: int = 0) -> Chance:
    """×100 F1 of the positive class (label 1) of uniform guesses against ``gold``: mean and spread of ``draws``."""
    import numpy as np

    y = np.asarray(gold) == 1
    guesses = np.random.default_rng(seed).integers(0, classes, size=(draws, len(y))) == 1
    tp = (guesses & y).sum(1)
    denom = guesses.sum(1) + y.sum()
    f1 = np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)
    return Chance(100 * float(f1.mean()), 100 * float(f1.std()),
                  f"F1 of uniform guesses among {classes} labels against the {len(y)} gold labels (simulated)")


def _range(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"
