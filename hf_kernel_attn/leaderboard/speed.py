"""The leaderboard's speed benchmark (``speed:`` in its config): interleaved whole-model forward timings of each
model's kernels, written to ``speed.jsonl``; the speed plot's x axis."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..fileio import append_jsonl_atomic, read_jsonl
from ..kernels import SOFTMAX
from ..model_paths import CorruptCheckpointError
from ..speed.model_bench import Rounds, bench_models, load_models
from .config import press_row
from .progress import duration, heartbeat

__all__ = ["SPEED_FILE", "time_models", "timed_as"]

SPEED_FILE = "speed.jsonl"
_RECORD_KEYS = ("model", "kernel", "length", "time_s", "ratio_vs_softmax", "status")


def time_models(cfg: dict[str, Any], path: Path) -> None:
    """Interleaved whole-model forward timings (speed/model_bench.py: every kernel in turn, rotating order, the
    median ratio to softmax) of each model's kernels at ``speed.length`` tokens, once per model: the speed
    plot's x axis, measured apart from evaluation so that machine load during a cell does not show as speed.
    Models already in ``path`` are skipped. Prints a line per (model, kernel) measured and, while the forwards
    run, a heartbeat with the count done."""
    done = {r["model"] for r in read_jsonl(path)}
    todo = [m for m in cfg["models"] if m["name"] not in done and not m.get("finetune")
            and any(_timed(m, k) for k in m["kernels"])]  # a converted row runs its base model's kernel: timed
    if todo:  # with the base model's row
        print(f"speed: timing {len(todo)} model(s), every kernel at {cfg['speed']['length']} tokens, "
              f"{cfg['speed']['repeats']} interleaved rounds", flush=True)
    for m in todo:
        if m["name"] in done:  # two entries of one model
            continue
        start = time.perf_counter()
        try:
            rows = _time_model(m, cfg["speed"]["length"], cfg["speed"]["repeats"])
        except CorruptCheckpointError as exc:  # the checkpoint, not the benchmark: as in the evaluation
            raise CorruptCheckpointError(f"leaderboard model {m['name']!r}: {exc}") from None
        except Exception as exc:  # the table stands without the plot
            print(f"{m['name']}: speed benchmark failed: {exc}", flush=True)
            continue
        append_jsonl_atomic(path, [{k: r[k] for k in _RECORD_KEYS} for r in rows])
        done.add(m["name"])
        print(f"{m['name']}: {duration(time.perf_counter() - start)}, speed benchmark done", flush=True)


def _timed(m: dict[str, Any], kernel: str) -> bool:
    """Whether the row ``kernel`` of entry ``m`` is a kernel the benchmark times (not "saved", not a press row)."""
    return kernel != "saved" and press_row(m, kernel) is None


def _time_model(m: dict[str, Any], length: int, repeats: int) -> list[dict[str, Any]]:
    """:func:`time_models` of one model entry: its rows of speed/model_bench.py's ``bench_models``."""
    label = f"speed {m['name']}"
    count: dict[str, Any] = {"forwards": 0, "total": 0, "last": "loading the models"}

    def status() -> str:
        if not count["total"]:
            return count["last"]
        return f"{count['forwards']}/{count['total']} forwards, last: {count['last']}"

    def counter(kernel: str) -> Callable[..., None]:
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
        models, kind = load_models(m["model"], kernels=[SOFTMAX, *(k for k in m["kernels"] if _timed(m, k))],
                                   gguf_file=m.get("gguf_file"), params=m.get("kernel_params"))
        runs = [k for k, model in models.items() if model is not None]
        for k in runs:
            models[k].register_forward_hook(counter(k))
        count.update(total=len(runs) * (1 + repeats), last="warm-up")  # bench_models' warm-up: one forward each
        return bench_models(models, kind, batches=[1], lengths=[length], rounds=Rounds(repeats=repeats),
                            model_name=m["name"], progress=measured)


def timed_as(cfg: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
    """(row of a converted entry, kernel) -> (the timed entry of the same base model, kernel): a converted model
    runs its base model's kernel, timed with that entry (see :func:`time_models`)."""
    timed: dict[str, str] = {}
    for m in cfg["models"]:
        if not m.get("finetune"):
            timed.setdefault(str(m.get("model")), m["name"])
    return {(m["name"], k): (timed[str(m.get("model"))], k) for m in cfg["models"]
            if m.get("finetune") and str(m.get("model")) in timed for k in m["kernels"]}
