"""Readers for the GLUE classification / regression tasks (sst2, mrpc, rte, cola, stsb, qnli).

Local layout (see ``shared/data/EVAL_SPLITS.md``): ``DATA_DIR/<task>/<file>``. Splits:

* ``train``: the task's train file minus the held-out rows (data row ``i`` is held out when
  ``i % holdout_every == holdout_every - 1``);
* ``validation``: only those held-out rows (for qnli, which has no train file: the evaluation file);
* ``test``: the standard evaluation file (GLUE dev), ``GlueTask.eval_file``.

With ``data_dir=None`` the same splits are built from the Hugging Face hub (``GlueTask.hub``), where
``test`` is the hub's ``validation`` split.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .files import json_objects, read_text_file

__all__ = ["GLUE_TASKS", "SPLITS", "GlueExample", "GlueTask", "load_glue", "read_glue_file"]

SPLITS: tuple[str, ...] = ("train", "validation", "test")


@dataclass(frozen=True)
class GlueTask:
    """Static description of one GLUE task: label space, metrics, local file names and hub id."""

    name: str
    num_labels: int
    is_regression: bool
    text_fields: str
    metrics: tuple[str, ...]
    train_file: str | None
    eval_file: str
    hub: tuple[str, str]


@dataclass
class GlueExample:
    """One example: a sentence (``text_b`` is None) or a sentence pair, and its label."""

    text_a: str
    text_b: str | None
    label: float | int


def _glue(name: str, text_fields: str, metrics: tuple[str, ...], train: str | None, eval_: str,
          regression: bool = False) -> GlueTask:
    return GlueTask(
        name, 1 if regression else 2, regression, text_fields, metrics, train, eval_, ("nyu-mll/glue", name)
    )


GLUE_TASKS: dict[str, GlueTask] = {
    "sst2": _glue("sst2", "sentence", ("accuracy",), "train.tsv", "dev.tsv"),
    "mrpc": _glue("mrpc", "#1 String / #2 String (sentence pair)", ("f1", "accuracy"), "train.tsv", "dev.tsv"),
    "rte": _glue(
        "rte", "sentence1 / sentence2 (premise, hypothesis)", ("accuracy",), "train.jsonl", "validation.jsonl"
    ),
    "cola": _glue("cola", "x (sentence)", ("matthews_correlation",), "train.tsv", "in_domain_dev.tsv"),
    "stsb": _glue("stsb", "sentence1 / sentence2 (sentence pair)", ("pearson", "spearman"), "train.tsv", "dev.tsv",
                  regression=True),
    "qnli": _glue("qnli", "question / sentence", ("accuracy",), None, "dev.tsv"),  # no train file distributed locally
}

_BINARY = {"0": 0, "1": 1}
_QNLI = {"entailment": 0, "not_entailment": 1}


@dataclass(frozen=True)
class _Format:
    """Where a task's texts and label live: local TSV/JSONL column names and hub column names."""

    text_a: str
    text_b: str | None
    label: str
    label_map: Mapping[str, int] | None  # None: float score in [0, 5]
    hub_text_a: str
    hub_text_b: str | None


_FORMATS: dict[str, _Format] = {
    "sst2": _Format("sentence", None, "label", _BINARY, "sentence", None),
    "mrpc": _Format("#1 String", "#2 String", "Quality", _BINARY, "sentence1", "sentence2"),
    "rte": _Format("sentence1", "sentence2", "label", _BINARY, "sentence1", "sentence2"),
    "cola": _Format("x", None, "y", _BINARY, "sentence", None),
    "stsb": _Format("sentence1", "sentence2", "score", None, "sentence1", "sentence2"),
    "qnli": _Format("question", "sentence", "label", _QNLI, "question", "sentence"),
}


def _task(task: str) -> GlueTask:
    if task not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; choose one of {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[task]


def _parse_label(fmt: _Format, raw: object, where: str) -> float | int:
    """Label from a TSV string or a JSON value; ValueError naming ``where`` (file:line) if invalid."""
    if fmt.label_map is None:
        try:
            if isinstance(raw, bool):
                raise TypeError
            score = float(raw.strip() if isinstance(raw, str) else raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{where}: unparsable score {raw!r} (expected a float in [0, 5])") from None
        if not (math.isfinite(score) and 0.0 <= score <= 5.0):
            raise ValueError(f"{where}: score {raw!r} is outside [0, 5]")
        return score
    if isinstance(raw, str) and raw.strip() in fmt.label_map:
        return fmt.label_map[raw.strip()]
    if isinstance(raw, int) and not isinstance(raw, bool) and raw in fmt.label_map.values():
        return raw
    raise ValueError(f"{where}: unparsable label {raw!r} (expected one of {sorted(fmt.label_map)})")


def _lines(path: Path) -> list[str]:
    """Lines without terminators (BOM stripped, CRLF tolerated, trailing blank lines dropped)."""
    text = read_text_file(path, "GLUE data file", encoding="utf-8-sig")
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _read_tsv(task: str, fmt: _Format, path: Path) -> list[GlueExample]:
    lines = _lines(path)
    if not lines:
        raise ValueError(f"{path}: empty file, expected a header row")
    header = lines[0].split("\t")
    if fmt.label not in header:
        raise ValueError(f"{path}: file has no labels (no {fmt.label!r} column in header {header}) for task {task!r}")
    wanted = [c for c in (fmt.text_a, fmt.text_b) if c is not None]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise ValueError(f"{path}: header {header} lacks column(s) {missing} for task {task!r}")
    ia, il = header.index(fmt.text_a), header.index(fmt.label)
    ib = header.index(fmt.text_b) if fmt.text_b is not None else None
    out = []
    for lineno, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != len(header):
            raise ValueError(f"{path}:{lineno}: expected {len(header)} tab-separated fields, got {len(fields)}")
        label = _parse_label(fmt, fields[il], f"{path}:{lineno}")
        out.append(GlueExample(fields[ia], fields[ib] if ib is not None else None, label))
    return out


def _read_jsonl(task: str, fmt: _Format, path: Path) -> list[GlueExample]:
    out = []
    for where, record in json_objects(_lines(path), path):
        if fmt.label not in record:
            raise ValueError(f"{where}: file has no labels (record without {fmt.label!r}) for task {task!r}")
        fields = [k for k in (fmt.text_a, fmt.text_b) if k is not None]
        missing = [k for k in fields if k not in record]
        if missing:
            raise ValueError(f"{where}: record lacks field(s) {missing} for task {task!r}; expected fields "
                             f"{[*fields, fmt.label]}, got {sorted(record)}")
        texts = [record[k] for k in fields]
        bad = [k for k, t in zip(fields, texts, strict=True) if not isinstance(t, str)]
        if bad:
            raise ValueError(f"{where}: field(s) {bad} must be strings, got {[record[k] for k in bad]!r}")
        label = _parse_label(fmt, record[fmt.label], where)
        out.append(GlueExample(texts[0], texts[1] if len(texts) > 1 else None, label))
    return out


def read_glue_file(task: str, path: str | os.PathLike[str]) -> list[GlueExample]:
    """Parse one labeled file in ``task``'s format (TSV with header, or JSONL for rte)."""
    _task(task)
    path = Path(path)
    fmt = _FORMATS[task]
    reader = _read_jsonl if GLUE_TASKS[task].eval_file.endswith(".jsonl") else _read_tsv  # rte: JSON lines
    return reader(task, fmt, path)


def holdout(rows: Iterable[GlueExample], holdout_every: int, held: bool) -> list[GlueExample]:
    """Row i is held out when i % holdout_every == holdout_every - 1: those rows (held) or the others."""
    return [r for i, r in enumerate(rows) if (i % holdout_every == holdout_every - 1) == held]


def _check_args(task: str, split: str, holdout_every: int) -> GlueTask:
    spec = _task(task)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
        raise ValueError(f"holdout_every must be an int >= 2, got {holdout_every!r}")
    return spec


def _local_file(spec: GlueTask, split: str, data_dir: str | os.PathLike[str], name: str | None) -> Path:
    folder = Path(data_dir).expanduser().absolute() / spec.name
    if name is None:
        raise FileNotFoundError(
            f"{spec.name} has no local train file (expected layout {folder}/<train file>) so split {split!r} "
            "cannot be read from data_dir; use data_dir=None to read it from the hub"
        )
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{spec.name} split {split!r}: expected file {path} not found")
    return path


def _hub_rows(spec: GlueTask, hub_split: str) -> list[GlueExample]:
    """Rows of one hub split as GlueExamples; RuntimeError with a clear message if it can't be loaded."""
    try:
        import datasets

        ds = datasets.load_dataset(*spec.hub, split=hub_split)
    except Exception as exc:  # offline, missing cache, no `datasets`: all reported the same way
        raise RuntimeError(
            f"could not load {spec.hub} split {hub_split!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "if offline, pass data_dir= pointing at a local copy (DATA_DIR/<task>/<file>)"
        ) from exc
    fmt = _FORMATS[spec.name]
    out = []
    for i, row in enumerate(ds):
        label = _parse_label(fmt, row["label"], f"hub {spec.hub} {hub_split} row {i}")
        text_b = row[fmt.hub_text_b] if fmt.hub_text_b is not None else None
        out.append(GlueExample(row[fmt.hub_text_a], text_b, label))
    return out


def load_glue(
    task: str, split: str, data_dir: str | os.PathLike[str] | None = None, holdout_every: int = 10
) -> list[GlueExample]:
    """Examples of ``task``'s ``split`` ("train", "validation" or "test"), from ``data_dir`` or the hub."""
    spec = _check_args(task, split, holdout_every)

    def read(which: str) -> list[GlueExample]:
        if data_dir is None:
            return _hub_rows(spec, "train" if which == "train" else "validation")
        name = spec.train_file if which == "train" else spec.eval_file
        return read_glue_file(task, _local_file(spec, split, data_dir, name))

    if split == "test" or (split == "validation" and spec.train_file is None):
        return read("eval")
    if spec.train_file is None:  # qnli train (hub only): validation is not drawn from train, nothing held out
        return read("train")
    return holdout(read("train"), holdout_every, held=split == "validation")
