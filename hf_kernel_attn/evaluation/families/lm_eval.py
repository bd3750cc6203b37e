"""Zero-shot tasks of lm-evaluation-harness (multiple choice, cloze) on local files.

An :class:`LmEvalTask` runs lm-eval's stock task of the same name (its YAML ``include``-d: same prompt, choices,
target and metrics) with the dataset swapped for the local files named in ``EVAL_SPLITS.md``, converted once to
the stock dataset's field layout by the task's ``convert`` function; numbers are therefore comparable with
published lm-eval results on the same split. Without ``--data-dir`` lm-eval loads the stock task from the hub.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...data.files import json_objects, read_text_file
from ..task import EVAL_TASKS, EvalRun, EvalTask

Converter = Callable[[list[Path]], list[dict[str, Any]]]


def _text(path: Path) -> str:
    return read_text_file(path, "data file")


def _need(row: dict[str, Any], fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; expected {list(fields)}, got {sorted(row)}")


def _jsonl(path: Path, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """JSON objects, one per non-blank line, each with ``fields``; ValueError naming file:line otherwise."""
    rows = []
    for where, row in json_objects(_text(path).splitlines(), path, skip_blank=True):
        _need(row, fields, where)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- converters
# local rows -> the stock dataset's fields (what the stock prompts read); each checks the fields it needs
# (EVAL_SPLITS.md) and reports a missing one with file:line

LAMBADA_FIELDS = ("text",)
ARC_FIELDS = ("id", "question", "answerKey")
PIQA_FIELDS = ("goal", "sol1", "sol2")
BOOLQ_FIELDS = ("question", "passage", "idx", "label")
COPA_FIELDS = ("premise", "choice1", "choice2", "question", "label", "idx")
OPENBOOKQA_FIELDS = ("ID", "Question Stem", "Choices", "Answer Key")


def convert_lambada(files: list[Path]) -> list[dict[str, Any]]:
    """LAMBADA: one passage per line of the plain-text file, or the ``text`` of each JSONL record."""
    if files[0].suffix == ".jsonl":
        return [{"text": r["text"]} for r in _jsonl(files[0], LAMBADA_FIELDS)]
    return [{"text": ln.strip()} for ln in _text(files[0]).splitlines() if ln.strip()]


def convert_arc(files: list[Path]) -> list[dict[str, Any]]:
    """ARC's JSONL (``question`` holding ``stem`` and ``choices``) -> the hub's flat fields."""
    rows = _jsonl(files[0], ARC_FIELDS)
    for i, r in enumerate(rows):
        q = r["question"]
        if not isinstance(q, dict) or "stem" not in q or not isinstance(q.get("choices"), list):
            raise ValueError(f"{files[0]}: record {i + 1} ({r.get('id')!r}): 'question' must hold 'stem' and a "
                             f"'choices' list, got {q!r}")
    return [{"id": r["id"], "question": r["question"]["stem"],
             "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                         "label": [c["label"] for c in r["question"]["choices"]]},
             "answerKey": r["answerKey"]} for r in rows]


def convert_piqa(files: list[Path]) -> list[dict[str, Any]]:
    """PIQA: the JSONL of questions and the labels file, one label per line."""
    rows = _jsonl(files[0], PIQA_FIELDS)
    labels = [ln.strip() for ln in _text(files[1]).splitlines() if ln.strip()]
    if len(labels) != len(rows):
        raise ValueError(f"{files[1]} has {len(labels)} labels for {len(rows)} rows of {files[0]}")
    return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(lab)}
            for r, lab in zip(rows, labels, strict=True)]


def convert_boolq(files: list[Path]) -> list[dict[str, Any]]:
    """BoolQ (SuperGLUE JSONL): the label as 0/1."""
    return [{"question": r["question"], "passage": r["passage"], "idx": r["idx"],
             "label": int(str(r["label"]).lower() in ("true", "1"))} for r in _jsonl(files[0], BOOLQ_FIELDS)]


def convert_copa(files: list[Path]) -> list[dict[str, Any]]:
    """COPA (SuperGLUE JSONL): the stock fields as they are."""
    return [{k: r[k] for k in COPA_FIELDS} for r in _jsonl(files[0], COPA_FIELDS)]


def convert_openbookqa(files: list[Path]) -> list[dict[str, Any]]:
    """OpenBookQA's TSV (``Choices`` as ``(A) text (B) text ...``) -> the hub's fields."""
    out = []
    _text(files[0])  # binary / non-UTF-8 files fail here, naming the file
    with open(files[0], encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = reader.fieldnames or []
        missing = [c for c in OPENBOOKQA_FIELDS if c not in header]
        if missing:
            raise ValueError(f"{files[0]}: header {header} lacks column(s) {missing}; expected "
                             f"{list(OPENBOOKQA_FIELDS)}")
        for r in reader:
            parts = re.split(r"\(([A-Z])\)\s*", r["Choices"])[1:]
            labels, texts = parts[0::2], [t.strip() for t in parts[1::2]]
            out.append({"id": r["ID"], "question_stem": r["Question Stem"],
                        "choices": {"text": texts, "label": labels}, "answerKey": r["Answer Key"].strip()})
    return out


CONVERTERS: dict[str, Converter] = {"lambada": convert_lambada, "arc": convert_arc, "piqa": convert_piqa,
                                    "boolq": convert_boolq, "copa": convert_copa, "openbookqa": convert_openbookqa}


# ------------------------------------------------------------------------------------------------ tasks
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class LmEvalTask(EvalTask):
    """lm-eval's stock task ``name`` (``stock``: its YAML, relative to ``lm_eval/tasks``) on the local files
    ``local_files[split]``, converted by ``convert``; ``main_metric`` is one of the metrics lm-eval reports."""

    name: str
    main_metric: str
    stock: str
    local_files: dict[str, tuple[str, ...]]
    convert: Converter
    model_kind = "causal_lm"

    def files(self, split: str) -> list[str]:
        return list(self.local_files[split])

    def rows(self, data_dir: str | os.PathLike, split: str) -> list[dict[str, Any]]:
        """The local files of ``split`` converted to the stock dataset's fields (checked: missing files, binary
        or non-UTF-8 files and missing fields raise, naming the file)."""
        files = [Path(data_dir) / f for f in self.local_files[split]]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{self.name} --split {split}: expected {missing} (see EVAL_SPLITS.md)")
        return self.convert(files)

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        self.rows(data_dir, split)

    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        return [run.record(*r[2:]) for r in run_lm_eval_tasks(run.model, run.tokenizer, [self.name],
                                                               data_dir=run.data_dir, split=run.split,
                                                               limit=run.limit, batch_size=run.batch_size)]


def _same(path: str) -> dict[str, tuple[str, ...]]:
    """One local file for both splits (the task publishes no labelled test set)."""
    return {"validation": (path,), "test": (path,)}


TASKS: tuple[LmEvalTask, ...] = (  # the built-in lm-eval tasks (registered by evaluation.tasks)
    LmEvalTask("lambada_openai", "acc", "lambada/lambada_openai.yaml",
               {"validation": ("lambada/lambada_development_plain_text.txt",),
                "test": ("lambada/lambada_openai_test.jsonl",)}, convert_lambada),
    LmEvalTask("arc_easy", "acc_norm", "arc/arc_easy.yaml",
               {"validation": ("arc/ARC-Easy-Dev.jsonl",), "test": ("arc/ARC-Easy-Test.jsonl",)}, convert_arc),
    LmEvalTask("arc_challenge", "acc_norm", "arc/arc_challenge.yaml",
               {"validation": ("arc/ARC-Challenge-Dev.jsonl",), "test": ("arc/ARC-Challenge-Test.jsonl",)},
               convert_arc),
    LmEvalTask("piqa", "acc_norm", "piqa/piqa.yaml",
               {"validation": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
                "test": ("piqa/valid.jsonl", "piqa/valid-labels.lst")}, convert_piqa),
    LmEvalTask("boolq", "acc", "super_glue/boolq/default.yaml", _same("boolq/val.jsonl"), convert_boolq),
    LmEvalTask("copa", "acc", "super_glue/copa/default.yaml", _same("copa/val.jsonl"), convert_copa),
    LmEvalTask("openbookqa", "acc_norm", "openbookqa/openbookqa.yaml",
               {"validation": ("openbookqa/dev.tsv",), "test": ("openbookqa/test.tsv",)}, convert_openbookqa),
)


def lm_eval_task_names() -> list[str]:
    """The lm-eval tasks with local files (the registered ones and the built-ins), sorted."""
    return sorted({n for n, t in EVAL_TASKS.items() if isinstance(t, LmEvalTask)} | {t.name for t in TASKS})


def lm_eval_task(name: str) -> LmEvalTask:
    """The lm-eval task ``name``: the registered one, else the built-in one (this module used on its own);
    ValueError listing them otherwise."""
    task = EVAL_TASKS.get(name) if name in EVAL_TASKS else {t.name: t for t in TASKS}.get(name)
    if not isinstance(task, LmEvalTask):
        raise ValueError(f"no local lm-eval config for {name!r}; available: {lm_eval_task_names()}")
    return task


def local_rows(task: str, data_dir: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """:meth:`LmEvalTask.rows` of the registered lm-eval task ``task``."""
    return lm_eval_task(task).rows(data_dir, split)


def local_task_dir(tasks: list[str], data_dir: str | os.PathLike, split: str, out_dir: str | os.PathLike) -> Path:
    """Write one lm-eval task config per task into ``out_dir`` (plus the converted data) and return it."""
    import lm_eval  # optional and heavy: only when lm-eval runs

    stock_root = Path(lm_eval.__file__).parent / "tasks"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in tasks:
        task = lm_eval_task(name)
        data = out / f"{name}.{split}.jsonl"
        rows = task.rows(data_dir, split)
        with open(data, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        stock_path = stock_root / task.stock
        if (stock_path.parent / "utils.py").exists():  # `!function utils.x` resolves next to *this* file
            (out / "utils.py").write_text((stock_path.parent / "utils.py").read_text())
        config = {
            "include": str(stock_path), "task": name, "tag": [],
            "dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": {"eval": str(data)}},
            "training_split": None, "validation_split": None, "test_split": "eval", "fewshot_split": None,
        }
        (out / f"{name}.yaml").write_text(json.dumps(config, indent=1))  # JSON is valid YAML
    return out


def run_lm_eval_tasks(model, tokenizer, tasks: list[str], *, data_dir: str | os.PathLike | None,
                      split: str, limit: int | None, batch_size: int) -> list[tuple]:
    """Run lm-eval on an in-memory model; returns (task, split, metric, value, stderr, n, seconds) tuples."""
    from lm_eval import simple_evaluate  # optional and heavy: only when lm-eval runs
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        if data_dir is not None:
            manager = TaskManager(include_path=str(local_task_dir(tasks, data_dir, split, tmp)), include_defaults=False)
        else:
            manager = TaskManager()
        results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                  num_fewshot=0, log_samples=False, bootstrap_iters=1000)
    secs = time.perf_counter() - start
    out = []
    for task in tasks:
        res = results["results"][task]
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        for key, value in res.items():
            if "," not in key or key.startswith("alias") or "_stderr" in key:
                continue
            metric = key.split(",")[0]
            stderr = res.get(f"{metric}_stderr,{key.split(',')[1]}")
            stderr = stderr if isinstance(stderr, (int, float)) else None
            out.append((task, split, metric, float(value), stderr, int(n or 0), secs))
    return out
