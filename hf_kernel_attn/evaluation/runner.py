"""``hf-kernel-attn eval``: load (or patch) a model once per head type, run the tasks, write one JSON
line per (model, kernel, layers, task, split, metric)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer

import hf_kernel_attn

from ..kernels import SOFTMAX
from ..model_paths import check_local_path, load_errors, locate_model
from .families.embedding import embed, mean_pool
from .families.long_context import COST_KEYS, LONG_CONTEXT_KEYS, PRESS_KEYS
from .long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from .long_context.plots import plot_long_context
from .presses import PRESSES, PressRunner, require_kvpress
from .task import EVAL_TASKS, MODEL_CLASSES, RECORD_KEYS, EvalOptions, EvalRun, EvalTask
from .tasks import check_data_files, check_split, check_split_of, get_task, get_tasks

__all__ = ["COST_KEYS", "LONG_CONTEXT_KEYS", "PRESS_KEYS", "RECORD_KEYS", "EvalSettings", "ModelSpec",
           "check_local_data", "check_model_path", "check_press", "embed", "mean_pool", "run_eval", "summary_table"]


@dataclasses.dataclass
class ModelSpec:
    """A saved model (its own kernel) or one patched on the fly with ``kernel``/``layers``/``params``."""

    model: str
    gguf_file: str | None = None
    kernel: str | None = None
    layers: Any = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def load(self, kind: str):
        """The model (``pkg:``, folder or hub id; see :mod:`hf_kernel_attn.model_paths`) and its tokenizer; a
        one-line ModelLoadError when it cannot be loaded."""
        if self.kernel is None and self.layers is not None:
            raise ValueError("--layers need --kernel (without it the model runs its saved kernel, with any --param "
                             "added to its options)")
        path = locate_model(self.model, self.gguf_file)
        kwargs = {"gguf_file": self.gguf_file} if self.gguf_file else {}
        cls = getattr(transformers, MODEL_CLASSES[kind])
        with load_errors(self.model, self.gguf_file):
            if self.kernel is not None or self.params:  # without --kernel, --param adds to the saved kernel's options
                model = hf_kernel_attn.from_pretrained(path, kernel=self.kernel, layers=self.layers,
                                                       model_class=cls, kernel_params=self.params, **kwargs)
            else:
                model = cls.from_pretrained(path, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model.eval(), tokenizer

    def describe(self, model) -> dict[str, Any]:
        """The ``model``, ``kernel``, ``params`` and ``layers`` fields of a result record."""
        return {"model": self.model, "kernel": self.kernel_name(model), "params": self.params_repr(model),
                "layers": self.layers_repr(model)}

    def kernel_name(self, model) -> str:
        cfg = hf_kernel_attn.kernel_config(model)
        return cfg.kernel if cfg else SOFTMAX

    def params_repr(self, model) -> dict[str, Any]:
        cfg = hf_kernel_attn.kernel_config(model)
        return dict(cfg.params) if cfg else {}

    def layers_repr(self, model) -> Any:
        cfg = hf_kernel_attn.kernel_config(model)
        return cfg.to_dict().get("layers") or None if cfg else None


def check_model_path(model: str) -> None:
    """Raise FileNotFoundError for a local model folder that does not exist. A hub id is ``name`` or
    ``namespace/name``; anything with more path parts, or starting with ``.``, ``/`` or ``~``, is a folder
    (otherwise transformers reports a missing folder as a malformed repo id). See
    :func:`hf_kernel_attn.model_paths.locate_model` for the full check."""
    check_local_path(model)


def check_local_data(tasks: list[str], split: str, data_dir: str | os.PathLike) -> None:
    """Before any model loads: every task's local files exist (the error lists the expected files) and
    parse (binary, non-UTF-8 or empty files and missing columns raise, naming the file)."""
    check_data_files(tasks, split, data_dir)
    for task in tasks:
        get_task(task).check_data(split, data_dir)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How :func:`run_eval` runs its tasks and where it writes: the options of ``hf-kernel-attn eval``, one field
    per flag of the same name. :meth:`task_options` is what the tasks read."""

    split: str = "validation"  # --split: validation or test
    data_dir: str | os.PathLike | None = None  # --data-dir: the local files of EVAL_SPLITS.md (None: the hub)
    limit: int | None = None  # --limit: the first N examples (perplexity: windows)
    batch_size: int = 1  # --batch-size
    context: int = 1024  # --context: perplexity window, tokens
    stride: int | None = None  # --stride: perplexity window step, tokens
    lengths: Sequence[int] = DEFAULT_LENGTHS  # --lengths: long-context prompt lengths, tokens
    depths: Sequence[float] = DEFAULT_DEPTHS  # --depths: long-context needle depths, percent
    samples: int = DEFAULT_SAMPLES  # --samples: prompts per long-context (length, depth) cell
    seed: int = 0  # --seed: of the long-context prompts
    output: str | os.PathLike | None = None  # --output: the JSONL file each record is appended to
    plot_dir: str | os.PathLike | None = None  # --plot-dir: long-context heat maps and loss curves
    press: str | None = None  # --press: a KV-cache press (evaluation.presses.PRESSES) on the softmax model
    compression: float | None = None  # --compression: the share of the context's K/V pairs the press removes
    press_bytes: int | None = None  # --press-bytes: instead, the K/V bytes to leave after each prompt's context

    def task_options(self) -> EvalOptions:
        """The options the tasks read (every field but ``output``, ``plot_dir`` and the press's)."""
        return EvalOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EvalOptions)})


def check_press(settings: EvalSettings, tasks: list[EvalTask], spec: ModelSpec | None = None) -> None:
    """Before any model loads: ``--press NAME`` with one of ``--compression R`` (in [0, 1)) and ``--press-bytes B``
    (>= 1), on long-context tasks that ask a question, on the model without ``--kernel``/``--param``/``--layers``;
    ValueError naming what is wrong (an unknown press: the valid names), then ImportError with the install line
    when kvpress is missing. Nothing without ``--press`` (then ``--compression``/``--press-bytes`` are refused)."""
    ratio, target = settings.compression, settings.press_bytes
    if settings.press is None:
        if ratio is not None or target is not None:
            raise ValueError("--compression and --press-bytes go with --press NAME")
        return
    PRESSES.get(settings.press)  # UnknownNameError (a ValueError) listing the presses
    if (ratio is None) == (target is None):
        raise ValueError("--press needs one of --compression R (the share of each context's K/V pairs the press "
                         "removes) and --press-bytes B (the K/V bytes to leave after each context)")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1):
        raise ValueError(f"--compression must be in [0, 1), got {ratio!r}")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 1):
        raise ValueError(f"--press-bytes must be an integer >= 1, got {target!r}")
    bad = [t.name for t in tasks if not t.takes_press]
    if bad:
        able = [name for name, task in EVAL_TASKS.items() if task.takes_press]
        raise ValueError(f"--press runs the long-context tasks that ask a question after a context ({able}), "
                         f"not {bad}")
    if spec is not None and (spec.kernel is not None or spec.params or spec.layers is not None):
        raise ValueError("--press runs on the unconverted softmax model (a press compresses its K/V cache): drop "
                         "--kernel, --param and --layers")
    require_kvpress()


def run_eval(spec: ModelSpec, tasks: list[str], settings: EvalSettings | None = None, *,
             models: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run ``tasks`` on the model of ``spec`` with ``settings`` (default: :class:`EvalSettings`'s defaults);
    append each record to ``settings.output`` (JSONL) as it finishes. Long-context tasks run every (length,
    depth) cell of ``lengths`` × ``depths`` with ``samples`` prompts, deterministic for ``seed``; ``plot_dir``
    gets their heat maps and loss curves. ``models``: a dict the caller keeps across calls for the same ``spec``
    (model kind -> loaded model and tokenizer), so that a sweep calling once per task loads the model once; a
    task that fails drops it (it may have left the model changed)."""
    settings = settings or EvalSettings()
    split, data_dir, limit, output = settings.split, settings.data_dir, settings.limit, settings.output
    objs: list[EvalTask] = get_tasks(tasks)
    options = settings.task_options()
    for obj in objs:
        obj.check_options(options)
    check_split(split)
    for obj in objs:
        check_split_of(obj, split)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {str(data_dir)!r} is not a folder")
    if data_dir is not None:
        check_local_data(tasks, split, data_dir)
    check_press(settings, objs, spec)
    records: list[dict[str, Any]] = []
    loaded: dict[str, Any] = {} if models is None else models
    for obj in objs:
        kind = obj.model_kind
        if kind not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[kind] = spec.load(kind)
        model, tok = loaded[kind]
        try:
            run = EvalRun.of(options, task=obj.name, model=model, tokenizer=tok,
                             describe=lambda model=model: spec.describe(model))
            if settings.press is not None:  # check_press: every task takes a press
                with PressRunner(model, settings.press, settings.compression,
                                 target_bytes=settings.press_bytes) as press:
                    new = obj.run_with_press(run, press)
            else:
                new = obj.run(run)
        except BaseException:
            loaded.clear()
            raise
        records += new
        if output:
            with open(output, "a") as f:
                for r in new:
                    f.write(json.dumps(r) + "\n")
    grids = {obj.name for obj in objs if obj.by_length}  # records per (length, depth) cell
    if settings.plot_dir is not None and any(r["task"] in grids for r in records):
        plot_long_context(records, settings.plot_dir)
    return records


def summary_table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'task':16s} {'split':10s} {'kernel':10s} {'metric':22s} {'length':>6s} {'depth':>5s} {'value':>10s} "
             f"{'stderr':>8s} {'n':>7s}"]
    for r in records:
        se = "" if r["stderr"] is None else f"{r['stderr']:.4g}"
        length = "" if r.get("length") is None else str(r["length"])
        depth = "" if r.get("depth") is None else f"{r['depth']:g}"
        kernel = r["kernel"] if r.get("press") is None else f"{r['kernel']}+{r['press']}"
        lines.append(f"{r['task']:16s} {r['split']:10s} {kernel:10s} {r['metric']:22s} {length:>6s} {depth:>5s} "
                     f"{r['value']:10.4f} {se:>8s} {r['n']:7d}")
    return "\n".join(lines)
