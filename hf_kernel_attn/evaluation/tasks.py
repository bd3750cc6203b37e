"""Evaluation tasks: every built-in family registered, and the names other code reads.

Importing this module registers the built-in tasks in :data:`~.task.EVAL_TASKS`, family by family (each
:mod:`.families` module's ``TASKS``): token-stream perplexity (``wikitext2``, ``ptb``, ``tinyshakespeare``), the
zero-shot multiple-choice / cloze tasks run through lm-evaluation-harness, GLUE (classification head), zero-shot
STS-B embeddings, and the long-context tasks. A task of one's own is an :class:`EvalTask` passed to
:func:`register_eval_task` in a module named by ``--import MODULE`` (or a leaderboard's ``imports:``).

Local data follows ``shared/data/EVAL_SPLITS.md``: ``--data-dir DIR --split validation`` reads the
development files, ``--split test`` the standard evaluation files of the same format.

The task tuples of earlier versions (``ALL_TASKS``, ``TEXT_TASKS``, ``LM_EVAL_TASKS`` ...) are live views of the
registry (:class:`~.task.TaskNames`, :class:`~.task.TaskMap`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .families import embedding, glue, lm_eval, long_context, ruler, text
from .families.embedding import EmbeddingTask
from .families.glue import GlueEvalTask, glue_metrics
from .families.lm_eval import LmEvalTask
from .families.long_context import LongContextEvalTask
from .families.ruler import RulerTask
from .families.text import TINYSHAKESPEARE_HOLDOUT, TextTask, read_text_task
from .task import (
    EVAL_TASKS,
    MODEL_CLASSES,
    SPLITS,
    EvalOptions,
    EvalRun,
    EvalTask,
    TaskMap,
    TaskNames,
    accuracy_stderr,
    check_split,
    check_split_of,
    check_tasks,
    get_task,
    get_tasks,
    register_eval_task,
)

__all__ = ["ALL_TASKS", "EMBEDDING_TASKS", "EVAL_TASKS", "GLUE_EVAL_TASKS", "LM_EVAL_TASKS", "LONG_CONTEXT_TASKS",
           "MODEL_CLASSES", "NATURAL_TEXT_TASKS", "RULER_TASKS", "SPLITS", "TEXT_TASKS", "TINYSHAKESPEARE_HOLDOUT",
           "EmbeddingTask", "EvalOptions", "EvalRun", "EvalTask", "GlueEvalTask", "LmEvalTask", "LongContextEvalTask",
           "RulerTask", "TextTask", "accuracy_stderr", "check_data_files", "check_split", "check_tasks",
           "expected_files", "get_task", "get_tasks", "glue_metrics", "model_kind", "read_text_task",
           "register_eval_task"]

for _task in (*text.TASKS, *lm_eval.TASKS, *glue.TASKS, *embedding.TASKS, *long_context.TASKS, *ruler.TASKS):
    register_eval_task(_task)  # the built-in tasks, family by family: the order of ALL_TASKS and of the messages

ALL_TASKS = TaskNames()
TEXT_TASKS: TaskMap[EvalTask] = TaskMap(lambda t: t, lambda t: isinstance(t, TextTask))
LM_EVAL_TASKS = TaskNames(lambda t: isinstance(t, LmEvalTask))
GLUE_EVAL_TASKS = TaskNames(lambda t: isinstance(t, GlueEvalTask))
EMBEDDING_TASKS = TaskNames(lambda t: isinstance(t, EmbeddingTask))
LONG_CONTEXT_TASKS = TaskNames(lambda t: isinstance(t, LongContextEvalTask))
RULER_TASKS = TaskNames(lambda t: isinstance(t, RulerTask))
NATURAL_TEXT_TASKS = TaskNames(lambda t: isinstance(t, LongContextEvalTask) and t.needs_text)  # read wikitext2


def model_kind(task: str) -> str:
    """Which model head ``task`` needs: a key of :data:`MODEL_CLASSES` (causal_lm, sequence_classification or
    embedding)."""
    return get_task(task).model_kind


def expected_files(task: str, split: str) -> list[str]:
    """The local files (relative to ``--data-dir``) that ``task`` reads for ``split`` (EVAL_SPLITS.md)."""
    obj = get_task(task)
    check_split(split)
    check_split_of(obj, split)
    return obj.files(split)


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
