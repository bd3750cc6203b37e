"""Recall against the decode cache that bought it: one point per leaderboard row (a model, a kernel, a KV-cache
press) at one prompt length, x = the cache's bytes after the prompt (log scale), y = recall, with the Pareto front
(the rows no cheaper row beats) drawn through them. Two panels per length: the RULER average (the mean of the
RULER tasks' scores the row has at that length) and ``niah`` (single needle, mean over depths).

:func:`recall_points` and :func:`pareto_front` are the content (pure); :func:`plot_recall_vs_bytes` writes
``recall_vs_bytes_<length>.png`` per length that has points.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..evaluation.families.ruler import RULER_TASKS, SCORE
from ..kernels import is_softmax

RULER_AVERAGE = "RULER average"
PANELS = {RULER_AVERAGE: (RULER_TASKS, SCORE), "niah": (("niah",), "exact_match")}  # panel -> (tasks, metric)
FILE = "recall_vs_bytes_{length}.png"


@dataclasses.dataclass(frozen=True)
class Point:
    """One row at one length: its ``label``, mean ``cache_bytes``, ``recall`` (percent) and the ``tasks`` averaged."""

    label: str
    cache_bytes: float
    recall: float
    tasks: int


def row_label(model_name: str, kernel_row: str) -> str:
    """A row's name on the plot: the model's name, with the kernel row unless it is plain softmax."""
    return model_name if is_softmax(kernel_row) else f"{model_name} / {kernel_row}"


def common_tasks(records: Sequence[dict[str, Any]], panel: str, length: int) -> tuple[str, ...]:
    """The tasks of ``panel`` that every row with a point at ``length`` has: an average over them compares rows
    on the same tasks."""
    tasks, metric = PANELS[panel]
    per_row: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in records:
        if r.get("task") in tasks and r.get("metric") == metric and r.get("length") == length \
                and r.get("cache_bytes") is not None:
            per_row[(r["model_name"], r["kernel_row"])].add(r["task"])
    shared = set.intersection(*per_row.values()) if per_row else set()
    return tuple(t for t in tasks if t in shared)


def recall_points(records: Sequence[dict[str, Any]], panel: str, length: int,
                  tasks: Sequence[str] | None = None) -> list[Point]:
    """The points of ``panel`` (a key of :data:`PANELS`) at ``length``: per row, the mean over its tasks (only
    ``tasks``, where given) of each task's mean score at that length, at the mean ``cache_bytes`` of those
    records; rows without cache bytes are left out."""
    panel_tasks, metric = PANELS[panel]
    tasks = panel_tasks if tasks is None else tuple(tasks)
    per_row: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("task") in tasks and r.get("metric") == metric and r.get("length") == length \
                and r.get("cache_bytes") is not None:
            per_row[(r["model_name"], r["kernel_row"])][r["task"]].append(r)
    points = []
    for (name, kernel), by_task in per_row.items():
        scores = [statistics.fmean(float(x["value"]) for x in rs) for rs in by_task.values()]
        cache = statistics.fmean(float(x["cache_bytes"]) for rs in by_task.values() for x in rs)
        points.append(Point(row_label(name, kernel), cache, statistics.fmean(scores), len(scores)))
    return sorted(points, key=lambda p: (p.cache_bytes, -p.recall))


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats: none with at most its bytes has more recall (ties: the cheaper one);
    ordered by bytes."""
    front: list[Point] = []
    for p in sorted(points, key=lambda p: (p.cache_bytes, -p.recall)):
        if not front or p.recall > front[-1].recall:
            front.append(p)
    return front


def bytes_table(records: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: per row and length, the RULER average and ``niah`` (percent), the decode cache after the
    prompt (MiB: the mean over the row's recall records at that length) and the decode step (ms/token: the median
    over the records that timed one, the generated answers of ``niah`` and ``passkey``); empty without cache
    bytes."""
    keyed: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if isinstance(r.get("length"), int) and r.get("cache_bytes") is not None:
            keyed[(r["model_name"], r["kernel_row"])][r["length"]].append(r)
    if not keyed:
        return []
    lines = ["| row | length | RULER average % | niah % | cache MiB | decode ms/token |", "|---|---|---|---|---|---|"]
    for (name, kernel), by_length in keyed.items():
        for length, rs in sorted(by_length.items()):
            cells = []
            for panel in PANELS:
                points = [p for p in recall_points(rs, panel, length) if p.label == row_label(name, kernel)]
                cells.append(f"{points[0].recall:.0f} ({points[0].tasks} tasks)" if panel == RULER_AVERAGE and points
                             else f"{points[0].recall:.0f}" if points else "–")
            cache = statistics.fmean(float(r["cache_bytes"]) for r in rs) / 2**20
            steps = [float(r["decode_ms_per_token"]) for r in rs if r.get("decode_ms_per_token") is not None]
            step = f"{statistics.median(steps):.0f}" if steps else "–"
            lines.append(f"| {row_label(name, kernel)} | {length} | {cells[0]} | {cells[1]} | {cache:.1f} | {step} |")
    return lines


def plot_recall_vs_bytes(records: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write one figure per length with points (``recall_vs_bytes_<length>.png``); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in records if isinstance(r.get("length"), int) and r.get("cache_bytes")})
    written = []
    for length in lengths:
        shared = {panel: common_tasks(records, panel, length) for panel in PANELS}
        panels = {panel: recall_points(records, panel, length, shared[panel]) for panel in PANELS}
        panels = {k: v for k, v in panels.items() if v}
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
        for ax, (panel, points) in zip(axes[0], panels.items(), strict=True):
            _draw(ax, panel, points, length)
            if panel == RULER_AVERAGE:
                ax.set_title(f"{panel} at {length} tokens\n(every row on {', '.join(shared[panel])})", fontsize=9)
        fig.tight_layout()
        path = Path(out_dir) / FILE.format(length=length)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _draw(ax, panel: str, points: list[Point], length: int) -> None:
    front = pareto_front(points)
    ax.step([p.cache_bytes / 2**20 for p in front], [p.recall for p in front], where="post", color="#999999",
            linewidth=1, zorder=1, label="Pareto front")
    for i, p in enumerate(points):
        ax.scatter(p.cache_bytes / 2**20, p.recall, s=36, zorder=2, marker="os^Dv<>P*X"[i % 10],
                   label=f"{p.label} ({p.cache_bytes / 2**20:.1f} MiB)")
    ax.set_xscale("log")
    ax.set_xlabel("decode cache after the prompt, MiB (log scale)")
    ax.set_ylabel(f"{panel}, %")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{panel} at {length} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="best")
