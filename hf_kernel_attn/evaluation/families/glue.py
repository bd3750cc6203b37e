"""GLUE classification (and STS-B regression) with a sequence-classification head: the metrics of each GLUE
task's definition (:data:`hf_kernel_attn.data.GLUE_TASKS`), ×100, through the shipped ``evaluate`` modules."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from ...data import GLUE_TASKS, load_glue
from ..metrics import load_metric
from ..task import EvalRun, EvalTask, accuracy_stderr

BATCH_SIZE = 16  # at least this many sentences per forward


def _accuracy(preds: list[Any], gold: list[Any]) -> tuple[float, float | None]:
    acc = load_metric("accuracy").compute(predictions=preds, references=gold)["accuracy"]
    return 100 * acc, 100 * accuracy_stderr([p == g for p, g in zip(preds, gold, strict=True)])


def _f1(preds: list[Any], gold: list[Any]) -> tuple[float, float | None]:
    return 100 * load_metric("f1").compute(predictions=preds, references=gold)["f1"], None


def _matthews(preds: list[Any], gold: list[Any]) -> tuple[float, float | None]:
    mcc = load_metric("matthews_correlation").compute(predictions=preds, references=gold)
    return 100 * mcc["matthews_correlation"], None


def _pearson(preds: list[Any], gold: list[Any]) -> tuple[float, float | None]:
    return 100 * load_metric("pearsonr").compute(predictions=preds, references=gold)["pearsonr"], None


def _spearman(preds: list[Any], gold: list[Any]) -> tuple[float, float | None]:
    return 100 * load_metric("spearmanr").compute(predictions=preds, references=gold)["spearmanr"], None


# a GLUE task's metric names (GlueTask.metrics) -> (value ×100, stderr)
METRICS = {"accuracy": _accuracy, "f1": _f1, "matthews_correlation": _matthews, "pearson": _pearson,
           "spearman": _spearman}


def glue_metrics(task: str, preds: list[Any], gold: list[Any]) -> dict[str, tuple[float, float | None]]:
    """The metrics of GLUE task ``task`` (its definition's, in order; accuracy for a task without one) ×100:
    {metric: (value, stderr)}."""
    spec = GLUE_TASKS.get(task)
    return {name: METRICS[name](preds, gold) for name in (spec.metrics if spec else ("accuracy",))}


def glue_files(glue: str, split: str) -> list[str]:
    """The local file of GLUE task ``glue`` for ``split``: ``validation`` is the training file (the task's
    development set), ``test`` the standard evaluation file (EVAL_SPLITS.md)."""
    spec = GLUE_TASKS[glue]
    name = spec.eval_file if split == "test" or spec.train_file is None else spec.train_file
    return [f"{spec.name}/{name}"]


def check_glue_rows(task: str, glue: str, split: str, data_dir: str | os.PathLike) -> None:
    """The local file of ``glue`` / ``split`` parses and holds examples (the error names the file)."""
    if not load_glue(glue, split, data_dir):
        raise ValueError(f"{task} --split {split}: the local file holds no examples")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class GlueEvalTask(EvalTask):
    """A GLUE task scored on a sequence-classification head (``glue``: the task of
    :data:`~hf_kernel_attn.data.GLUE_TASKS`, by default the same name)."""

    name: str
    main_metric: str
    glue: str = ""
    model_kind = "sequence_classification"

    def __post_init__(self) -> None:
        if not self.glue:
            object.__setattr__(self, "glue", self.name)

    def files(self, split: str) -> list[str]:
        return glue_files(self.glue, split)

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        check_glue_rows(self.name, self.glue, split, data_dir)

    @torch.no_grad()
    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        start = time.perf_counter()
        rows = load_glue(self.glue, run.split, run.data_dir)[: run.limit or None]
        batch_size = max(run.batch_size, BATCH_SIZE)
        preds, gold = [], []
        for s in tqdm(range(0, len(rows), batch_size), desc=self.name, leave=False):
            part = rows[s:s + batch_size]
            pair = [r.text_b for r in part] if part[0].text_b is not None else None
            enc = run.tokenizer([r.text_a for r in part], pair, padding=True, truncation=True, max_length=512,
                                return_tensors="pt")
            logits = run.model(**enc).logits
            preds += (logits[:, 0] if logits.shape[-1] == 1 else logits.argmax(-1)).tolist()
            gold += [r.label for r in part]
        secs = time.perf_counter() - start
        return [run.record(metric, value, se, len(rows), secs)
                for metric, (value, se) in glue_metrics(self.glue, preds, gold).items()]


TASKS: tuple[GlueEvalTask, ...] = (  # the built-in GLUE tasks (registered by evaluation.tasks)
    GlueEvalTask("sst2", "accuracy"), GlueEvalTask("mrpc", "f1"), GlueEvalTask("rte", "accuracy"),
    GlueEvalTask("cola", "matthews_correlation"), GlueEvalTask("stsb", "spearman"))
