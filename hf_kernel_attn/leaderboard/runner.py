"""``hf-kernel-attn leaderboard CONFIG.yaml``: models × kernels × tasks, resumable, rendered as
``leaderboard.md``, ``leaderboard.csv`` and PNG plots (the config: :mod:`.config`).

A cell is one (model, kernel, task). Its records are added to ``results.jsonl`` only after the
cell finished, and atomically (the whole file is rewritten into a temporary file, synced, and renamed
over the old one), so a sweep killed at any moment, or a full disk, leaves either the old or the new
file, never a half-written cell; a re-run skips every cell that already has records. A cell that fails
(e.g. its data file is missing) is written to ``errors.jsonl`` and shown as such; it is retried only
with ``--retry-errors``. A damaged checkpoint is no cell's failure: a model folder whose files are truncated or
not what they claim to be stops the sweep before it starts, and one whose tensors turn out, as it loads, to have
other shapes than its config.json gives stops it then (rows already running in worker processes finish and are
kept); either is one ``error:`` line naming the file, and a re-run, once the checkpoint is fixed, goes on.

Progress: every cell prints when it starts and what it scored, a conversion its steps (at least every 30 s),
the speed benchmark each (model, kernel) it timed, and any step that runs longer than
:data:`~.progress.HEARTBEAT_SECONDS` (30) a ``still running`` line, in worker processes too (they share the
terminal, line-buffered).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from ..fileio import append_jsonl_atomic, read_jsonl, write_text_atomic
from .config import load_leaderboard_config, require_presses
from .render import render
from .speed import SPEED_FILE, time_models
from .workers import PendingRow, evaluate_row, evaluate_rows_in_workers

__all__ = ["leaderboard", "run_leaderboard"]


def leaderboard(config_path: str | os.PathLike, data_dir: str | None = None, output_dir: str | None = None,
                retry_errors: bool = False, jobs: int | None = None,
                overrides: list[str] | None = None, quick: bool = False) -> dict[str, Any]:
    """The ``leaderboard`` command: read and check the config (``quick``: with its ``quick:`` overrides), then
    :func:`run_leaderboard`."""
    cfg = load_leaderboard_config(config_path, data_dir, output_dir, jobs, overrides, quick=quick)
    return run_leaderboard(copy.deepcopy(cfg), retry_errors=retry_errors)


def run_leaderboard(cfg: dict[str, Any], retry_errors: bool = False) -> dict[str, Any]:
    """Evaluate every cell of a checked config that has neither records nor (unless ``retry_errors``) an error,
    time the models where it says ``speed``, and render; returns the table (:func:`~.render.render`) with the
    ``seconds`` it took."""
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    results_path, errors_path = out / "results.jsonl", out / "errors.jsonl"
    for stale in [*out.glob(".results.jsonl.*.tmp"), *out.glob(".errors.jsonl.*.tmp")]:
        stale.unlink()  # left by a sweep killed while replacing a file; the file itself is intact
    done = {(r["model_name"], r["kernel_row"], r["task"], r["split"]) for r in read_jsonl(results_path)}
    errors = [] if retry_errors else [e for e in read_jsonl(errors_path) if e.get("split") == cfg["split"]]
    done |= {(e["model_name"], e["kernel_row"], e["task"], cfg["split"]) for e in errors}
    start = time.perf_counter()
    rows: list[PendingRow] = [(m, kernel, [t for t in m["tasks"] if (m["name"], kernel, t, cfg["split"]) not in done])
                              for m in cfg["models"] for kernel in m["kernels"]]
    rows = [r for r in rows if r[2]]
    require_presses([(m, kernel) for m, kernel, _ in rows], cfg.get("press_python"))  # before any row loads
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
                evaluate_row(cfg, m, kernel, todo, emit)
        else:
            evaluate_rows_in_workers(cfg, rows, emit)
    finally:
        write_text_atomic(errors_path, "".join(json.dumps(e) + "\n" for e in errors))
    if cfg.get("speed"):
        time_models(cfg, out / SPEED_FILE)
    table = render(cfg, read_jsonl(results_path), errors)
    table["seconds"] = time.perf_counter() - start
    return table
