"""A sweep's records as its outputs: ``leaderboard.md`` (the table, the chance levels, the failed cells),
``leaderboard.csv``, and the plots (:mod:`.plots`; long-context tasks also their own grid plots).

The heat map shows each cell relative to the model's softmax row, except cells at or below the task's chance level
(:mod:`.chance`: from the task's definition and the evaluated items), which are hatched and read ``chance``;
leaderboard.md lists the chance levels and those cells."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..evaluation.families.ruler import RULER_TASKS
from ..evaluation.long_context.plots import plot_long_context
from ..evaluation.task import TaskMap, find_task, main_metric
from ..fileio import read_jsonl
from .bytes_plot import bytes_table, plot_recall_vs_bytes
from .chance import Chance, at_chance, chance_level
from .plots import CHANCE_RULE, Key, write_plots
from .progress import heartbeat
from .speed import SPEED_FILE, timed_as

__all__ = ["MAIN_METRIC", "render"]

MAIN_METRIC: TaskMap[str] = TaskMap(lambda t: t.main_metric)  # task -> its main metric (a live view)

Row = tuple[str, str]  # (model name, kernel)


def render(cfg: dict[str, Any], records: list[dict[str, Any]], errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Write leaderboard.md, leaderboard.csv and the plots; return the table."""
    out = Path(cfg["output_dir"])
    split = cfg["split"]
    rows: list[Row] = []
    columns: list[str] = []
    for m in cfg["models"]:
        for kernel in m["kernels"]:
            if (m["name"], kernel) not in rows:  # one row may take its tasks from several entries
                rows.append((m["name"], kernel))
        for t in m["tasks"]:
            if t not in columns:
                columns.append(t)
    columns = [c for t in columns for c in _columns(t, cfg)]
    cell = _cells(records, split)
    failed = {(e["model_name"], e["kernel_row"], c): e["error"] for e in errors for c in _columns(e["task"], cfg)}
    header = ["model", "kernel"] + [f"{t} ({main_metric(t.split('@')[0]) or '?'})" for t in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    csv_rows: list[list[Any]] = [["model", "kernel", "task", "metric", "value", "stderr", "n", "split", "cache_bytes"]]
    for name, kernel in rows:
        values = []
        for t in columns:
            r = cell.get((name, kernel, t))
            if r is not None:
                se = f" ± {r['stderr']:.3g}" if r.get("stderr") else ""
                cache = f" ({_bytes(r['cache_bytes'])})" if r.get("press") and r.get("cache_bytes") else ""
                values.append(f"{r['value']:.4g}{se}{cache}")
                csv_rows.append([name, kernel, t, r["metric"], r["value"], r.get("stderr"), r["n"], split,
                                 r.get("cache_bytes")])
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
    recall_bytes = bytes_table([r for r in records if r["split"] == split and _by_length(r["task"])])
    if recall_bytes:
        notes += ["\nRecall against the decode cache that bought it (recall_vs_bytes_<length>.png):\n",
                  *recall_bytes, ""]
    (out / "leaderboard.md").write_text("\n".join(lines) + "\n" + "\n".join(notes) + "\n")
    with open(out / "leaderboard.csv", "w", newline="") as f:
        csv.writer(f).writerows(csv_rows)
    with heartbeat("plots"):
        written = write_plots(out, rows, columns, cell, chances, read_jsonl(out / SPEED_FILE), timed_as(cfg))
    if written:
        print(f"plots: wrote {', '.join(str(p) for p in written)}", flush=True)
    long_records = [r for r in records if r["split"] == split and _by_length(r["task"])]
    grid_records = [r for r in long_records if r["task"] not in RULER_TASKS]  # RULER has no depth grid
    try:
        if grid_records:
            plot_long_context(grid_records, out / "long_context")
        if any(r.get("cache_bytes") for r in long_records):
            written = plot_recall_vs_bytes(long_records, out)
            if written:
                print(f"plots: wrote {', '.join(str(p) for p in written)}", flush=True)
    except ImportError:  # no matplotlib: the table without its plots
        pass
    return {"rows": rows, "columns": columns, "markdown": "\n".join(lines)}


def _cells(records: list[dict[str, Any]], split: str) -> dict[Key, dict[str, Any]]:
    """The table's cells: each (row, column)'s main-metric record of ``split``; a long-context column's the mean
    over its depths."""
    cell: dict[Key, dict[str, Any]] = {}
    long_cells: dict[Key, list[dict[str, Any]]] = {}
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
        cache = [g["cache_bytes"] for g in group if g.get("cache_bytes") is not None]
        if cache:  # the K/V bytes after the context, mean over the depths (a press row's: what its press left)
            cell[key]["cache_bytes"] = round(sum(cache) / len(cache))
    return cell


def _bytes(n: float) -> str:
    """A byte count as leaderboard.md shows it beside a press row's long-context score."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


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


def _chances(cfg: dict[str, Any], cell: Mapping[Key, dict[str, Any]]) -> dict[Key, Chance | None]:
    """Each scored cell's chance level (:mod:`.chance`: from the task's definition and data; None for
    perplexity)."""
    return {key: chance_level(key[2].split("@")[0], r["metric"], r.get("n"), split=cfg["split"],
                              data_dir=cfg.get("data_dir"), record=r)
            for key, r in cell.items()}


def _chance_notes(rows: Sequence[Row], columns: Sequence[str], cell: Mapping[Key, dict[str, Any]],
                  chances: Mapping[Key, Chance | None]) -> list[str]:
    """leaderboard.md's lines on chance: each column's level(s) and the cells at or below it."""
    lines = []
    for t in columns:
        levels: dict[tuple[float, str], list[Row]] = {}
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
