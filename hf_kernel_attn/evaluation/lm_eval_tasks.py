"""lm-evaluation-harness integration: the ``hf-kernel-attn`` model type and local copies of stock tasks.

* ``KernelHFLM`` (registered as ``--model hf-kernel-attn``) is lm-eval's ``HFLM`` around a model that
  was loaded with its saved kernel, or patched on the fly: ``--model_args pretrained=DIR,kernel=gaussian,
  layers=[0,1],kernel_params={"projection":"full"},gguf_file=F``.
* :func:`local_task_dir` writes task configs that ``include`` lm-eval's stock YAML for the task of the
  same name — same prompt, choices, target and metrics — and only swap the dataset for the local files
  named in ``EVAL_SPLITS.md`` (converted once to the stock field layout). Numbers are therefore
  comparable with published lm-eval results on the same split.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from ..data.files import json_objects
from ..model_paths import PKG_PREFIX, resolve_package_path

# task -> (stock yaml relative to lm_eval/tasks, {split: local files}, converter name)
_LOCAL = {
    "lambada_openai": ("lambada/lambada_openai.yaml",
                       {"validation": ["lambada/lambada_development_plain_text.txt"],
                        "test": ["lambada/lambada_openai_test.jsonl"]}, "lambada"),
    "arc_easy": ("arc/arc_easy.yaml", {"validation": ["arc/ARC-Easy-Dev.jsonl"], "test": ["arc/ARC-Easy-Test.jsonl"]},
                 "arc"),
    "arc_challenge": ("arc/arc_challenge.yaml", {"validation": ["arc/ARC-Challenge-Dev.jsonl"],
                                                 "test": ["arc/ARC-Challenge-Test.jsonl"]}, "arc"),
    "piqa": ("piqa/piqa.yaml", {"validation": ["piqa/valid.jsonl", "piqa/valid-labels.lst"],
                                "test": ["piqa/valid.jsonl", "piqa/valid-labels.lst"]}, "piqa"),
    "boolq": ("super_glue/boolq/default.yaml", {"validation": ["boolq/val.jsonl"], "test": ["boolq/val.jsonl"]},
              "boolq"),
    "copa": ("super_glue/copa/default.yaml", {"validation": ["copa/val.jsonl"], "test": ["copa/val.jsonl"]},
             "copa"),
    "openbookqa": ("openbookqa/openbookqa.yaml", {"validation": ["openbookqa/dev.tsv"],
                                                  "test": ["openbookqa/test.tsv"]}, "openbookqa"),
}


# fields each local file must have (EVAL_SPLITS.md); a missing one is reported with file:line
_FIELDS = {
    "lambada": ("text",), "arc": ("id", "question", "answerKey"), "piqa": ("goal", "sol1", "sol2"),
    "boolq": ("question", "passage", "idx", "label"),
    "copa": ("premise", "choice1", "choice2", "question", "label", "idx"),
    "openbookqa": ("ID", "Question Stem", "Choices", "Answer Key"),
}


def _text(path: Path) -> str:
    from ..data.files import read_text_file

    return read_text_file(path, "data file")


def _jsonl(path: Path, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """JSON objects, one per non-blank line, each with ``fields``; ValueError naming file:line otherwise."""
    rows = []
    for where, row in json_objects(_text(path).splitlines(), path, skip_blank=True):
        _need(row, fields, where)
        rows.append(row)
    return rows


def _need(row: dict[str, Any], fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; expected {list(fields)}, got {sorted(row)}")


def _convert(kind: str, files: list[Path]) -> list[dict[str, Any]]:
    """Local rows -> the stock dataset's fields (what the stock prompts read)."""
    if kind == "lambada":
        if files[0].suffix == ".jsonl":
            return [{"text": r["text"]} for r in _jsonl(files[0], _FIELDS[kind])]
        return [{"text": ln.strip()} for ln in _text(files[0]).splitlines() if ln.strip()]
    if kind == "arc":
        rows = _jsonl(files[0], _FIELDS[kind])
        for i, r in enumerate(rows):
            q = r["question"]
            if not isinstance(q, dict) or "stem" not in q or not isinstance(q.get("choices"), list):
                raise ValueError(f"{files[0]}: record {i + 1} ({r.get('id')!r}): 'question' must hold 'stem' and a "
                                 f"'choices' list, got {q!r}")
        return [{"id": r["id"], "question": r["question"]["stem"],
                 "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                             "label": [c["label"] for c in r["question"]["choices"]]},
                 "answerKey": r["answerKey"]} for r in rows]
    if kind == "piqa":
        rows = _jsonl(files[0], _FIELDS[kind])
        labels = [ln.strip() for ln in _text(files[1]).splitlines() if ln.strip()]
        if len(labels) != len(rows):
            raise ValueError(f"{files[1]} has {len(labels)} labels for {len(rows)} rows of {files[0]}")
        return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(lab)}
                for r, lab in zip(rows, labels, strict=True)]
    if kind == "boolq":
        return [{"question": r["question"], "passage": r["passage"], "idx": r["idx"],
                 "label": int(str(r["label"]).lower() in ("true", "1"))} for r in _jsonl(files[0], _FIELDS[kind])]
    if kind == "copa":
        return [{k: r[k] for k in ("premise", "choice1", "choice2", "question", "label", "idx")}
                for r in _jsonl(files[0], _FIELDS[kind])]
    if kind == "openbookqa":
        out = []
        _text(files[0])  # binary / non-UTF-8 files fail here, naming the file
        with open(files[0], encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = reader.fieldnames or []
            missing = [c for c in _FIELDS[kind] if c not in header]
            if missing:
                raise ValueError(f"{files[0]}: header {header} lacks column(s) {missing}; expected "
                                 f"{list(_FIELDS[kind])}")
            for r in reader:
                parts = re.split(r"\(([A-Z])\)\s*", r["Choices"])[1:]
                labels, texts = parts[0::2], [t.strip() for t in parts[1::2]]
                out.append({"id": r["ID"], "question_stem": r["Question Stem"],
                            "choices": {"text": texts, "label": labels}, "answerKey": r["Answer Key"].strip()})
        return out
    raise ValueError(kind)


def local_rows(task: str, data_dir: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """The local files of ``task`` / ``split`` converted to the stock dataset's fields (checked: missing files,
    binary or non-UTF-8 files and missing fields raise, naming the file)."""
    if task not in _LOCAL:
        raise ValueError(f"no local lm-eval config for {task!r}; available: {sorted(_LOCAL)}")
    _, splits, kind = _LOCAL[task]
    files = [Path(data_dir) / f for f in splits[split]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{task} --split {split}: expected {missing} (see EVAL_SPLITS.md)")
    return _convert(kind, files)


def local_task_dir(tasks: list[str], data_dir: str | os.PathLike, split: str, out_dir: str | os.PathLike) -> Path:
    """Write one lm-eval task config per task into ``out_dir`` (plus the converted data) and return it."""
    import lm_eval

    stock_root = Path(lm_eval.__file__).parent / "tasks"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if task not in _LOCAL:
            raise ValueError(f"no local lm-eval config for {task!r}; available: {sorted(_LOCAL)}")
        stock = _LOCAL[task][0]
        data = out / f"{task}.{split}.jsonl"
        rows = local_rows(task, data_dir, split)
        with open(data, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        stock_path = stock_root / stock
        if (stock_path.parent / "utils.py").exists():  # `!function utils.x` resolves next to *this* file
            (out / "utils.py").write_text((stock_path.parent / "utils.py").read_text())
        config = {
            "include": str(stock_path), "task": task, "tag": [],
            "dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": {"eval": str(data)}},
            "training_split": None, "validation_split": None, "test_split": "eval", "fewshot_split": None,
        }
        (out / f"{task}.yaml").write_text(json.dumps(config, indent=1))  # JSON is valid YAML
    return out


def _parse_layers(value: Any) -> Any:
    if isinstance(value, str):
        return json.loads(value)
    return value


def register_model() -> None:
    """Register ``KernelHFLM`` as lm-eval model type ``hf-kernel-attn`` (idempotent)."""
    from lm_eval.api.registry import MODEL_REGISTRY
    from lm_eval.api.registry import register_model as lm_register
    from lm_eval.models.huggingface import HFLM

    if "hf-kernel-attn" in MODEL_REGISTRY:
        return

    @lm_register("hf-kernel-attn")
    class KernelHFLM(HFLM):
        """lm-eval's HFLM with the model's saved kernel, or ``kernel=...`` patched on the fly."""

        def __init__(self, pretrained: Any, kernel: str | None = None, layers: Any = None,
                     kernel_params: Any = None, gguf_file: str | None = None, **kwargs: Any) -> None:
            import hf_kernel_attn

            if isinstance(pretrained, str):
                if pretrained.startswith(PKG_PREFIX):
                    pretrained = resolve_package_path(pretrained)
                params = json.loads(kernel_params) if isinstance(kernel_params, str) else dict(kernel_params or {})
                load = {"gguf_file": gguf_file} if gguf_file else {}
                if kernel:
                    model = hf_kernel_attn.from_pretrained(pretrained, kernel=kernel, layers=_parse_layers(layers),
                                                           kernel_params=params, **load)
                else:
                    from transformers import AutoModelForCausalLM

                    model = AutoModelForCausalLM.from_pretrained(pretrained, **load)
                if "tokenizer" not in kwargs:
                    from transformers import AutoTokenizer

                    kwargs["tokenizer"] = AutoTokenizer.from_pretrained(pretrained, **load)
                pretrained = model.eval()
            super().__init__(pretrained=pretrained, **kwargs)


def run_lm_eval_tasks(model, tokenizer, tasks: list[str], *, data_dir: str | os.PathLike | None,
                      split: str, limit: int | None, batch_size: int) -> list[tuple]:
    """Run lm-eval on an in-memory model; returns (task, split, metric, value, stderr, n, seconds) tuples."""
    import time

    from lm_eval import simple_evaluate
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


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """``--name VALUE`` or ``--name=VALUE`` out of ``argv``: the value (None if absent) and the rest."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == name:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"{name} expects a value")
            value = argv[i + 1]
            i += 2
            continue
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def local_task_args(argv: list[str], work_dir: str | os.PathLike) -> list[str]:
    """lm-eval command-line arguments with ``--data-dir DIR`` (and ``--split validation|test``, default
    validation) replaced by ``--include_path`` to local copies of the ``--tasks`` named (written into
    ``work_dir``), so that the stock tasks run offline on the files of ``EVAL_SPLITS.md``. Without
    ``--data-dir`` the arguments come back unchanged (lm-eval then loads its tasks from the hub)."""
    data_dir, rest = _take_option(list(argv), "--data-dir")
    split, rest = _take_option(rest, "--split")
    if data_dir is None:
        if split is not None:
            raise ValueError("--split only applies with --data-dir (the local task files)")
        return list(argv)
    split = split or "validation"
    if split not in ("validation", "test"):
        raise ValueError(f"--split must be validation or test, got {split!r}")
    tasks, _ = _take_option(rest, "--tasks")
    if not tasks:
        raise ValueError(f"--data-dir needs --tasks with tasks that have local files: {sorted(_LOCAL)}")
    names = [t for t in tasks.split(",") if t]
    unknown = [t for t in names if t not in _LOCAL]
    if unknown:
        raise ValueError(f"--data-dir: no local files for task(s) {unknown}; tasks with local files: {sorted(_LOCAL)}")
    folder = local_task_dir(names, data_dir, split, work_dir)
    return [*rest, "--include_path", str(folder)]
