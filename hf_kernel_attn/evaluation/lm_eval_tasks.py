"""lm-evaluation-harness integration: the ``hf-kernel-attn`` model type and ``lm-eval`` on local files.

* ``KernelHFLM`` (registered as ``--model hf-kernel-attn``) is lm-eval's ``HFLM`` around a model that
  was loaded with its saved kernel, or patched on the fly: ``--model_args pretrained=DIR,kernel=gaussian,
  layers=[0,1],kernel_params={"projection":"full"},gguf_file=F``.
* :func:`local_task_args` turns ``hf-kernel-attn lm-eval ... --data-dir DIR`` into lm-eval arguments that run the
  registered :class:`~hf_kernel_attn.evaluation.families.lm_eval.LmEvalTask` tasks offline: task configs that
  ``include`` lm-eval's stock YAML for the task of the same name (same prompt, choices, target and metrics) and
  only swap the dataset for the local files named in ``EVAL_SPLITS.md`` (:func:`local_task_dir`). Numbers are
  therefore comparable with published lm-eval results on the same split.

The tasks themselves (stock YAML, local files, converters) live in :mod:`.families.lm_eval`; :func:`local_rows`,
:func:`local_task_dir` and :func:`run_lm_eval_tasks` are re-exported from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hf_kernel_attn

from ..model_paths import PKG_PREFIX, load_errors, resolve_package_path
from .families.lm_eval import CONVERTERS, lm_eval_task_names, local_rows, local_task_dir, run_lm_eval_tasks

__all__ = ["local_rows", "local_task_args", "local_task_dir", "register_model", "run_lm_eval_tasks"]


def _convert(kind: str, files: list[Path]) -> list[dict[str, Any]]:
    """Local rows -> the stock dataset's fields, by the converter's name (``arc``, ``piqa`` ...: a key of
    :data:`~.families.lm_eval.CONVERTERS`)."""
    if kind not in CONVERTERS:
        raise ValueError(f"no converter {kind!r}; converters: {sorted(CONVERTERS)}")
    return CONVERTERS[kind](files)


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
            if isinstance(pretrained, str):
                name = pretrained
                if pretrained.startswith(PKG_PREFIX):
                    pretrained = resolve_package_path(pretrained)
                params = json.loads(kernel_params) if isinstance(kernel_params, str) else dict(kernel_params or {})
                load = {"gguf_file": gguf_file} if gguf_file else {}
                with load_errors(name, gguf_file):  # a damaged checkpoint: one line naming the file
                    if kernel:
                        model = hf_kernel_attn.from_pretrained(pretrained, kernel=kernel,
                                                               layers=_parse_layers(layers), kernel_params=params,
                                                               **load)
                    else:
                        from transformers import AutoModelForCausalLM

                        model = AutoModelForCausalLM.from_pretrained(pretrained, **load)
                    if "tokenizer" not in kwargs:
                        from transformers import AutoTokenizer

                        kwargs["tokenizer"] = AutoTokenizer.from_pretrained(pretrained, **load)
                pretrained = model.eval()
            super().__init__(pretrained=pretrained, **kwargs)


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
    local = lm_eval_task_names()
    if not tasks:
        raise ValueError(f"--data-dir needs --tasks with tasks that have local files: {local}")
    names = [t for t in tasks.split(",") if t]
    unknown = [t for t in names if t not in local]
    if unknown:
        raise ValueError(f"--data-dir: no local files for task(s) {unknown}; tasks with local files: {local}")
    folder = local_task_dir(names, data_dir, split, work_dir)
    return [*rest, "--include_path", str(folder)]
