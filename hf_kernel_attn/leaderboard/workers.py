"""Evaluating a sweep's rows: one (model, kernel) row converted where its entry says ``finetune`` (resumed where a
conversion was interrupted), then scored task by task; in this process or in ``jobs`` spawned worker processes.
Nothing here writes results: each finished or failed cell goes to an ``emit`` callback (in the main process)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..evaluation.runner import EvalSettings, ModelSpec, run_eval
from ..evaluation.task import main_metric
from ..kernels import import_modules, is_softmax
from ..model_paths import CorruptCheckpointError
from ..training import finetune, load_config
from .config import press_here, press_row, task_limit
from .progress import duration, heartbeat

__all__ = ["DAMAGED", "Emit", "PendingRow", "converts", "eval_in_interpreter", "evaluate_row",
           "evaluate_rows_in_workers"]

DAMAGED = "damaged"  # what a worker returns, besides its cells and errors, for a row whose checkpoint is damaged
Emit = Callable[[str, dict[str, Any], str, Any], None]  # emit(kind "cell" | "error", model entry, kernel, payload)
PendingRow = tuple[dict[str, Any], str, list[str]]  # (model entry, kernel, the tasks still to evaluate)


def converts(m: dict[str, Any], kernel: str) -> bool:
    """Whether the row of entry ``m`` and ``kernel`` is a conversion (a ``finetune`` entry, a kernel not softmax)."""
    return bool(m.get("finetune")) and not is_softmax(kernel) and press_row(m, kernel) is None


def _finetuned(cfg: dict[str, Any], m: dict[str, Any], kernel: str) -> str:
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
    print(f"{label}: finished in {duration(time.perf_counter() - start)}", flush=True)
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


def evaluate_row(cfg: dict[str, Any], m: dict[str, Any], kernel: str, todo: list[str], emit: Emit) -> None:
    """One (model, kernel) row: its conversion first where the entry says ``finetune``, then each pending task;
    ``emit("cell", m, kernel, records)`` per finished task, ``emit("error", m, kernel, error)`` per failed one. A
    checkpoint that turns out damaged as it loads raises CorruptCheckpointError, naming the entry: no cell's
    failure, it stops the sweep."""
    def error(task: str, exc: Exception, trace: bool = True) -> dict[str, Any]:
        return {"model_name": m["name"], "kernel_row": kernel, "task": task, "split": cfg["split"],
                "error": repr(exc), **({"traceback": traceback.format_exc(limit=3)} if trace else {})}

    model_path, spec_kernel, gguf = m["model"], kernel, m.get("gguf_file")
    if converts(m, kernel):
        threads = torch.get_num_threads()
        try:
            model_path, spec_kernel, gguf = _finetuned(cfg, m, kernel), None, None
        except Exception as exc:  # a failed conversion marks the row's cells, the sweep goes on
            for task in todo:
                emit("error", m, kernel, error(task, exc, trace=False))
            return
        finally:  # the conversion sets its own thread count
            torch.set_num_threads(threads)
    press = press_row(m, kernel) or {}  # a press row: the unconverted model, each context compressed by the press
    if kernel == "saved" or press:  # the model as saved (e.g. a converted model folder)
        spec_kernel = None
    params = (m.get("kernel_params") or {}).get(kernel, {})
    spec = ModelSpec(model_path, gguf, spec_kernel, m.get("layers") if spec_kernel else None,
                     params if spec_kernel else {})
    models: dict[str, Any] = {}  # the row's model, loaded once for all its tasks (run_eval keeps it here)
    for task in todo:
        label = f"{m['name']} {kernel} {task}"
        limit = task_limit(cfg, task)
        print(f"{label}: evaluating" + (f" (limit {limit})" if limit else ""), flush=True)
        start = time.perf_counter()
        try:
            with heartbeat(label):
                settings = EvalSettings(split=cfg["split"], data_dir=cfg["data_dir"], limit=limit,
                                        batch_size=cfg["batch_size"], context=cfg["context"],
                                        lengths=m.get("lengths", cfg["lengths"]), depths=m.get("depths", cfg["depths"]),
                                        samples=m.get("samples", cfg["samples"]), seed=cfg["seed"], **press)
                if press and not press_here(cfg):
                    records = eval_in_interpreter(cfg["press_python"], spec, task, settings)
                else:
                    records = run_eval(spec, [task], settings, models=models)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"leaderboard model {m['name']!r}: {exc}") from None
        except Exception as exc:
            emit("error", m, kernel, error(task, exc))
            continue
        main = [r for r in records if r["metric"] == main_metric(task)]
        score = f"{main[0]['metric']} {main[0]['value']:.4g}" if len(main) == 1 else f"{len(records)} records"
        print(f"{label}: {score} in {duration(time.perf_counter() - start)}", flush=True)
        emit("cell", m, kernel, records)


# the longest a press cell (one task at every length) may run in the other interpreter; its cells take minutes, but
# lm-eval's RULER `vt` builder can loop for ever when no sample fits a length (its retry loop stops shrinking the
# haystack and catches every exception, so only ending the process stops it)
PRESS_CELL_SECONDS = 3600


def eval_in_interpreter(python: str, spec: ModelSpec, task: str, settings: EvalSettings,
                        timeout: float = PRESS_CELL_SECONDS) -> list[dict[str, Any]]:
    """``task`` on the model of ``spec`` with ``settings`` by ``hf-kernel-attn eval`` in another Python interpreter
    (``press_python``: the environment where kvpress fits); its records, as :func:`run_eval` returns them.
    RuntimeError with the end of its error output when it fails, or when it is still running after ``timeout``
    seconds (then it is killed)."""
    with tempfile.TemporaryDirectory(prefix="hf_kernel_attn-press-") as tmp:
        output = Path(tmp) / "records.jsonl"
        argv = [python, "-m", "hf_kernel_attn.cli", "eval", "--model", str(spec.model), "--tasks", task,
                "--split", settings.split, "--batch-size", str(settings.batch_size), "--context", str(settings.context),
                "--lengths", *map(str, settings.lengths), "--depths", *map(str, settings.depths),
                "--samples", str(settings.samples), "--seed", str(settings.seed), "--press", str(settings.press),
                "--threads", str(torch.get_num_threads()), "--output", str(output)]
        argv += ["--gguf-file", spec.gguf_file] if spec.gguf_file else []
        argv += ["--data-dir", str(settings.data_dir)] if settings.data_dir is not None else []
        argv += ["--limit", str(settings.limit)] if settings.limit is not None else []
        argv += (["--compression", str(settings.compression)] if settings.compression is not None
                 else ["--press-bytes", str(settings.press_bytes)])
        try:
            proc = subprocess.run(argv, stdout=sys.stdout, stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{python} ran `hf-kernel-attn eval` for {task} and was stopped after {timeout:.0f} s "
                               f"(lm-eval's RULER builders can loop for ever when no prompt fits a length: leave "
                               f"that task or length out)") from None
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{python} ran `hf-kernel-attn eval` for {task} and failed (exit {proc.returncode}): "
                               f"{tail}")
        return [json.loads(line) for line in output.read_text().splitlines() if line.strip()]


def _row_in_worker(cfg: dict[str, Any], m: dict[str, Any], kernel: str, todo: list[str],
                   threads: int) -> list[tuple[str, Any]]:
    """:func:`evaluate_row` in a spawned worker (it imports the user's kernel modules itself); returns what it
    emitted, for the main process to write, and last, where the row's checkpoint turned out damaged,
    ``("damaged", message)`` (its one line, not the worker's traceback)."""
    for stream in (sys.stdout, sys.stderr):  # the worker shares the terminal: each line as it is printed, even
        with contextlib.suppress(AttributeError, ValueError):  # when that is a pipe or a log file
            stream.reconfigure(line_buffering=True)
    import_modules(cfg.get("imports", []), where="leaderboard imports")
    torch.set_num_threads(threads)
    print(f"{m['name']} {kernel}: row started in worker process {os.getpid()} ({threads} thread(s))", flush=True)
    out: list[tuple[str, Any]] = []
    try:
        evaluate_row(cfg, m, kernel, todo, lambda kind, _m, _k, payload: out.append((kind, payload)))
    except CorruptCheckpointError as exc:
        out.append((DAMAGED, str(exc)))
    return out


def _die_with_parent(parent: int) -> None:
    """Worker initializer (Linux): SIGKILL this worker when the sweep's process dies, so that a killed sweep
    leaves no conversion running that a re-run would start again into the same folder."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker finishes its row, its result is dropped
        return
    if os.getppid() != parent:  # the parent died before the call above
        os._exit(1)


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def evaluate_rows_in_workers(cfg: dict[str, Any], rows: list[PendingRow], emit: Emit) -> None:
    """Rows in ``jobs`` spawned processes, the conversions first (the longest), each worker on its share of
    the cores; only this process writes results, a row at a time as its worker finishes it. A row whose
    checkpoint turned out damaged cancels the rows not started; the running ones finish and are written, then its
    CorruptCheckpointError is raised here."""
    jobs = min(cfg["jobs"], len(rows))
    threads = max(1, _cores() // jobs)
    rows = sorted(rows, key=lambda r: not converts(r[0], r[1]))  # stable: otherwise the config's order
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(_row_in_worker, cfg, m, kernel, todo, threads): (m, kernel, todo)
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
