"""Long-context figures: per model an accuracy heat map over length × depth (the usual NIAH picture), several
models side by side; and next-token loss against position, one curve per model."""

from __future__ import annotations

import os
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from .base import TASKS


def record_label(r: dict[str, Any]) -> str:
    """A row name: the leaderboard's model name and kernel row, or the kernel with its options."""
    if r.get("model_name"):
        row = r.get("kernel_row")
        return r["model_name"] if row in (None, "saved") else f"{r['model_name']} / {row}"
    opts = " ".join(f"{k}={v}" for k, v in sorted((r.get("params") or {}).items()))
    return " ".join(x for x in (r.get("kernel", "?"), opts, "hybrid" if r.get("layers") else "") if x)


def plot_long_context(records: list[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """Write ``{task}_{metric}.png`` heat maps and ``position_loss.png``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    grids: dict[tuple[str, str], dict[str, dict[tuple[int, float], float]]] = defaultdict(lambda: defaultdict(dict))
    curves: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for r in records:
        if r.get("length") is None:
            continue
        task = TASKS[r["task"]] if r["task"] in TASKS else None
        if task is not None and task.plot == "curve":
            curves[record_label(r)].append((r.get("position_start", 0), r["length"], r["value"]))
        elif r.get("depth") is not None:
            grids[(r["task"], r["metric"])][record_label(r)][(r["length"], r["depth"])] = r["value"]
    for (task, metric), models in grids.items():
        names = list(models)
        cols = min(3, len(names))
        rows = -(-len(names) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.6 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):
            cells = models[name]
            lengths = sorted({k[0] for k in cells})
            depths = sorted({k[1] for k in cells})
            grid = np.full((len(depths), len(lengths)), np.nan)
            for (n, d), v in cells.items():
                grid[depths.index(d), lengths.index(n)] = v
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
            ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=8)
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7)
            ax.set_title("\n".join(textwrap.wrap(name, 40)), fontsize=8)
            ax.set_xlabel("context length (tokens)", fontsize=8)
            ax.set_ylabel("needle depth", fontsize=8)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        fig.subplots_adjust(hspace=0.75, wspace=0.35)
        fig.colorbar(im, ax=axes, shrink=0.8, label=f"{metric} (%)")
        fig.suptitle(f"{task}: {metric}")
        path = out / f"{task}_{metric}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    if curves:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, pts in curves.items():
            pts = sorted(pts)
            ax.plot([(a + b) / 2 for a, b, _ in pts], [v for _, _, v in pts], marker="o",
                    label="\n".join(textwrap.wrap(name, 50)))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token position (bucket middle)")
        ax.set_ylabel("next-token loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("position_loss: does loss keep falling with more context?")
        fig.tight_layout()
        path = out / "position_loss.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
