"""The evaluation task contract and its registry.

An :class:`EvalTask` is one task of ``hf-kernel-attn eval`` and of the leaderboard: its name, the model head it
needs (:data:`MODEL_CLASSES`), its main metric and that metric's direction, the local files it reads for a split
(named in the "expected files" error), the checks of those files, and :meth:`EvalTask.run`, which scores a loaded
model and returns the JSONL records. Every task lives in :data:`EVAL_TASKS` (a
:class:`~hf_kernel_attn.registry.Registry` of instances): the built-in ones, one module per family, are registered
by importing :mod:`hf_kernel_attn.evaluation.tasks`; a task of one's own is a module that calls
:func:`register_eval_task`, named by ``--import MODULE`` or a leaderboard's ``imports:``.

This module imports neither torch nor transformers, and nothing of the task families.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ..registry import Registry, describe
from .long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES

SPLITS = ("validation", "test")
# model kind -> the transformers Auto class `eval` loads for it (one model in memory at a time)
MODEL_CLASSES: dict[str, str] = {"causal_lm": "AutoModelForCausalLM",
                                 "sequence_classification": "AutoModelForSequenceClassification",
                                 "embedding": "AutoModel"}
LOWER_IS_BETTER = frozenset({"perplexity", "bits_per_byte", "loss"})  # metrics where lower is better, by name
RECORD_KEYS = ("model", "kernel", "params", "layers", "task", "split", "metric", "value", "stderr", "n", "seconds")


@dataclasses.dataclass
class EvalOptions:
    """The options of ``eval`` that tasks read (each family its own: ``context``/``stride`` for perplexity,
    ``lengths``/``depths``/``samples``/``seed`` for the long-context grid)."""

    split: str = "validation"
    data_dir: str | os.PathLike | None = None  # None: the hub
    limit: int | None = None  # the first N examples (perplexity: windows)
    batch_size: int = 1
    context: int = 1024
    stride: int | None = None
    lengths: Sequence[int] = DEFAULT_LENGTHS
    depths: Sequence[float] = DEFAULT_DEPTHS
    samples: int = DEFAULT_SAMPLES
    seed: int = 0


@dataclasses.dataclass
class EvalRun(EvalOptions):
    """What :meth:`EvalTask.run` gets: the options, the loaded ``model`` and ``tokenizer``, and :meth:`record`,
    which builds one result record (``describe()`` gives the model's ``model``, ``kernel``, ``params`` and
    ``layers`` fields)."""

    task: str = ""
    model: Any = None
    tokenizer: Any = None
    describe: Callable[[], dict[str, Any]] = dict

    @classmethod
    def of(cls, options: EvalOptions, **fields: Any) -> EvalRun:
        """``options`` plus the run's own fields."""
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(EvalOptions)}, **fields)

    def record(self, metric: str, value: float, stderr: float | None, n: int, seconds: float) -> dict[str, Any]:
        """One result record, keys in :data:`RECORD_KEYS` order (a family may add keys after them)."""
        return {**self.describe(), "task": self.task, "split": self.split, "metric": metric, "value": value,
                "stderr": stderr, "n": n, "seconds": round(seconds, 2)}


class EvalTask:
    """One evaluation task. A subclass sets ``name``, ``model_kind`` (a key of :data:`MODEL_CLASSES`) and
    ``main_metric`` (the leaderboard's column; ``lower_is_better`` its direction), and implements
    :meth:`files` and :meth:`run`; :meth:`check_data` and :meth:`check_options` are optional checks that run
    before any model loads. ``by_length``: the records carry ``length`` and ``depth`` (the long-context grid), so
    the leaderboard shows one column per length."""

    name: str
    model_kind: str
    main_metric: str
    lower_is_better: bool = False
    by_length: bool = False
    splits: tuple[str, ...] = SPLITS
    hub_task_type: str = "text-generation"  # a model card's task type for this task's results
    takes_press: bool = False  # a KV-cache press can run it (it asks a question after a context): run_with_press

    def files(self, split: str) -> list[str]:
        """The local files (relative to ``--data-dir``) the task reads for ``split`` (EVAL_SPLITS.md)."""
        raise NotImplementedError

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        """Parse the local files of ``split`` (they exist): raise naming the file if one cannot be used."""

    def check_options(self, options: EvalOptions) -> None:
        """Raise a ValueError for options the task cannot run with (before any model loads)."""

    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        """Score ``run.model`` on ``run.split``; the records, built with ``run.record``."""
        raise NotImplementedError

    def run_with_press(self, run: EvalRun, press: Any) -> list[dict[str, Any]]:
        """:meth:`run` with each prompt's context compressed by ``press`` (a
        :class:`~hf_kernel_attn.evaluation.presses.PressRunner` on ``run.model``) before its question: tasks
        with ``takes_press`` implement it."""
        raise ValueError(f"a KV-cache press cannot run {self.name!r}: it asks no question after a context")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


EVAL_TASKS: Registry[EvalTask] = Registry(
    "evaluation task", EvalTask, instances=True,
    hint="a task of your own: an EvalTask registered with hf_kernel_attn.evaluation.tasks.register_eval_task in a "
         "module named by --import MODULE or a leaderboard's imports:")

TaskT = TypeVar("TaskT", bound="EvalTask | type[EvalTask]")
V = TypeVar("V")


def register_eval_task(task: TaskT) -> TaskT:
    """Add ``task`` (an :class:`EvalTask` instance, or a subclass, which is instantiated: usable as a class
    decorator) to :data:`EVAL_TASKS` under its name, and return it. ValueError naming what is wrong with a task
    that cannot work (no name, an unknown model kind, no main metric); the registry's duplicate rules apply."""
    obj = task() if isinstance(task, type) and issubclass(task, EvalTask) else task
    if not isinstance(obj, EvalTask):
        raise TypeError(f"register_eval_task takes an EvalTask (instance or subclass), got {task!r}")
    what = type(obj).__qualname__
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name or "@" in name or "," in name:
        raise ValueError(f"{what} needs a name: a non-empty string without '@' or ',', got {name!r}")
    if getattr(obj, "model_kind", None) not in MODEL_CLASSES:
        raise ValueError(f"task {name!r}: model_kind must be one of {list(MODEL_CLASSES)}, got "
                         f"{getattr(obj, 'model_kind', None)!r}")
    metric = getattr(obj, "main_metric", None)
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"task {name!r}: main_metric must be the name of the metric the leaderboard shows, "
                         f"got {metric!r}")
    bad = [s for s in obj.splits if s not in SPLITS]
    if not obj.splits or bad:
        raise ValueError(f"task {name!r}: splits must be among {list(SPLITS)}, got {list(obj.splits)!r}")
    if isinstance(task, type) and name in EVAL_TASKS and describe(type(EVAL_TASKS.get(name))) == describe(task):
        EVAL_TASKS.pop(name)  # the same class again (or its module run again): its new instance replaces the old
    EVAL_TASKS.register(name, obj)
    return task


def check_split(split: str) -> None:
    """ValueError for a split that is not one of :data:`SPLITS`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")


def check_tasks(tasks: list[str]) -> None:
    """ValueError naming every unknown task and listing the registered ones."""
    unknown = [t for t in tasks if t not in EVAL_TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available tasks: {list(EVAL_TASKS)} ({EVAL_TASKS.hint})")


def get_task(name: str) -> EvalTask:
    """The registered task ``name``; the :func:`check_tasks` error otherwise."""
    check_tasks([name])
    return EVAL_TASKS.get(name)


def get_tasks(names: list[str]) -> list[EvalTask]:
    """The registered tasks ``names`` (every unknown one named in one error)."""
    check_tasks(names)
    return [EVAL_TASKS.get(n) for n in names]


def find_task(name: str) -> EvalTask | None:
    """The registered task ``name``, or None (a leaderboard may show records of tasks that are not registered,
    e.g. the synthetic settings of ``similarity``)."""
    return EVAL_TASKS.get(name) if name in EVAL_TASKS else None


def main_metric(name: str) -> str | None:
    """The main metric of task ``name``, None when no such task is registered."""
    task = find_task(name)
    return None if task is None else task.main_metric


def lower_is_better(name: str, metric: str) -> bool:
    """Whether a lower ``metric`` of task ``name`` is better: the task's own direction for its main metric,
    otherwise by the metric's name (:data:`LOWER_IS_BETTER`)."""
    task = find_task(name)
    if task is not None and metric == task.main_metric:
        return task.lower_is_better
    return metric in LOWER_IS_BETTER


def check_split_of(task: EvalTask, split: str) -> None:
    """ValueError when ``task`` has no ``split``."""
    if split not in task.splits:
        raise ValueError(f"task {task.name!r} has no {split!r} split; its splits: {list(task.splits)}")


def accuracy_stderr(correct: list[bool]) -> float:
    """Standard error of the mean of 0/1 outcomes, sqrt(p(1-p)/(n-1)) (lm-eval's mean_stderr)."""
    n = len(correct)
    if n < 2:
        return float("nan")
    p = sum(correct) / n
    return math.sqrt(p * (1 - p) / (n - 1))


def _every(task: EvalTask) -> bool:
    return True


class TaskNames(Sequence[str]):
    """A live, read-only view of the names of the registered tasks that pass ``keep`` (registration order): a
    task registered later is in it. Compares equal to a tuple or list of the same names."""

    def __init__(self, keep: Callable[[EvalTask], bool] = _every) -> None:
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, t in EVAL_TASKS.items() if self._keep(t))

    def __getitem__(self, index):  # type: ignore[override]
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in EVAL_TASKS and self._keep(EVAL_TASKS.get(name))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TaskNames, tuple, list)):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._names())


class TaskMap(Mapping[str, V]):
    """A live, read-only mapping view: registered task name -> ``value(task)``, over the tasks that pass
    ``keep`` (e.g. ``TaskMap(lambda t: t.main_metric)``: every task's main metric)."""

    def __init__(self, value: Callable[[EvalTask], V], keep: Callable[[EvalTask], bool] = _every) -> None:
        self._value = value
        self._names = TaskNames(keep)

    def __getitem__(self, name: str) -> V:
        if name not in self._names:
            raise KeyError(name)
        return self._value(EVAL_TASKS.get(name))

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __repr__(self) -> str:
        return repr(dict(self))
