"""The leaderboard's plots: the kernel × task heat map (relative to softmax, cells at chance hatched) and the
quality-versus-speed plot (one panel per timed model).

:func:`heat_grid` is the heat map's content (pure: ratios to softmax and the at-chance mask); the figure
functions return matplotlib figures, written by :func:`write_plots`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..evaluation.task import lower_is_better
from ..kernels import SOFTMAX, is_softmax
from .chance import Chance, at_chance

HEAT_RANGE = 3.0  # the heat map's colour scale: log2 ratios in [-3, 3] (1/8x ... 8x softmax)
CHANCE_FACE, CHANCE_EDGE, CHANCE_HATCH = "#d9d9d9", "#8c8c8c", "///"
CHANCE_TEXT = "chance"
CHANCE_RULE = "score ≤ chance + 1 standard error of guessing on the same items"
MARKERS = ("o", "s", "^", "D", "v")
HEATMAP_FILE, SPEED_PLOT_FILE = "leaderboard_heatmap.png", "leaderboard_speed.png"

Key = tuple[str, str, str]  # (model name, kernel row, column)


def heat_values(ratios):
    """log2 of the quality ratios, clipped to the colour scale: a 0 score (log2 0 = -inf, which imshow leaves
    blank) is the bottom colour, an unbounded one the top; a missing cell (NaN) stays blank."""
    import numpy as np

    with np.errstate(divide="ignore"):
        return np.clip(np.log2(ratios), -HEAT_RANGE, HEAT_RANGE)


def heat_grid(rows: Sequence[tuple[str, str]], columns: Sequence[str], cell: Mapping[Key, dict[str, Any]],
              chances: Mapping[Key, Chance | None]):
    """``(ratios, at_chance)``, both ``[len(rows), len(columns)]``. A cell at or below its chance level
    (:func:`.chance.at_chance`) is True in ``at_chance`` and NaN in ``ratios``; any other cell is its score
    over the same model's softmax score (inverted where lower is better, e.g. perplexity and losses: > 1 is
    better), or over the first softmax row of that column for a model without one (a converted model's own row);
    NaN without a score or a baseline."""
    import numpy as np

    ratios = np.full((len(rows), len(columns)), np.nan)
    chance = np.zeros((len(rows), len(columns)), dtype=bool)
    first_softmax: dict[str, dict[str, Any]] = {}
    for name, kernel in rows:
        for t in columns:
            if is_softmax(kernel) and (name, kernel, t) in cell:
                first_softmax.setdefault(t, cell[(name, kernel, t)])
    for i, (name, kernel) in enumerate(rows):
        for j, t in enumerate(columns):
            r = cell.get((name, kernel, t))
            if r is None:
                continue
            if at_chance(r["value"], chances.get((name, kernel, t))):
                chance[i, j] = True
                continue
            base = cell.get((name, SOFTMAX, t), first_softmax.get(t))
            if base is None or not base["value"]:
                continue
            ratio = r["value"] / base["value"]
            ratios[i, j] = 1 / ratio if lower_is_better(r.get("task", t), r["metric"]) else ratio
    return ratios, chance


def _column_label(column: str, cell: Mapping[Key, dict[str, Any]], chances: Mapping[Key, Chance | None]) -> str:
    metric = next((r["metric"] for k, r in cell.items() if k[2] == column), "")
    levels = sorted({round(c.value, 3) for k, c in chances.items() if k[2] == column and c is not None})
    label = f"{column}\n{metric}" if metric else column
    if len(levels) == 1:
        label += f", chance {levels[0]:.3g}"
    elif levels:
        label += f", chance {levels[0]:.3g}-{levels[-1]:.3g}"
    return label


def heatmap_figure(rows: Sequence[tuple[str, str]], columns: Sequence[str], cell: Mapping[Key, dict[str, Any]],
                   chances: Mapping[Key, Chance | None]):
    """The heat map: colour = log2 of :func:`heat_grid`'s ratio, hatched grey ``chance`` cells at chance."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch, Rectangle

    ratios, chance = heat_grid(rows, columns, cell, chances)
    fig, ax = plt.subplots(figsize=(2.4 + 1.45 * len(columns), 1.6 + 0.42 * len(rows)))
    values = heat_values(ratios)
    im = ax.imshow(values, cmap="RdYlGn", vmin=-HEAT_RANGE, vmax=HEAT_RANGE, aspect="auto")
    ax.set_xticks(range(len(columns)), [_column_label(c, cell, chances) for c in columns], rotation=30, ha="right",
                  fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{n} / {k}" for n, k in rows], fontsize=8)
    ax.set_xlabel("task (metric; chance level)")
    ax.set_ylabel("model / kernel")
    for i in range(len(rows)):
        for j in range(len(columns)):
            if chance[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=CHANCE_FACE, edgecolor=CHANCE_EDGE,
                                       hatch=CHANCE_HATCH, linewidth=0))
                ax.text(j, i, CHANCE_TEXT, ha="center", va="center", fontsize=8, style="italic",
                        bbox={"facecolor": CHANCE_FACE, "edgecolor": "none", "pad": 1})
            elif not np.isnan(ratios[i, j]):
                dark = abs(values[i, j]) > 0.75 * HEAT_RANGE
                ax.text(j, i, f"{ratios[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
    ticks = np.arange(-HEAT_RANGE, HEAT_RANGE + 1)
    bar = fig.colorbar(im, ax=ax, ticks=ticks)
    bar.ax.set_yticklabels([f"{2.0 ** t:g}" if t >= 0 else f"1/{2.0 ** -t:g}" for t in ticks])
    bar.set_label("score / the model's softmax score\n(perplexity: softmax's / kernel's; > 1 is better; log scale)")
    ax.set_title("Kernel × task quality relative to softmax")
    fig.tight_layout()
    fig.legend(handles=[Patch(facecolor=CHANCE_FACE, edgecolor=CHANCE_EDGE, hatch=CHANCE_HATCH,
                              label=f"{CHANCE_TEXT}: at or below chance, {CHANCE_RULE}\n(multiple choice: mean "
                                    "1/choices; open answers and correlations: 0; perplexity: none)"),
                        Patch(facecolor="white", edgecolor=CHANCE_EDGE,
                              label="blank: not scored, or no softmax score")],
               loc="upper left", bbox_to_anchor=(0.01, 0.0), fontsize=8, frameon=False)  # below the figure
    return fig


def _quality_column(model_rows: Sequence[tuple[str, str]], columns: Sequence[str],
                    cell: Mapping[Key, dict[str, Any]]) -> str | None:
    """The column a model's panel plots: its first perplexity column, else its first scored column."""
    metric = {c: r["metric"] for c in columns for n, k in model_rows if (r := cell.get((n, k, c))) is not None}
    scored = [c for c in columns if c in metric]
    return next((c for c in scored if metric[c] == "perplexity"), scored[0] if scored else None)


def speed_figure(rows: Sequence[tuple[str, str]], columns: Sequence[str], cell: Mapping[Key, dict[str, Any]],
                 speed_rows: Sequence[dict[str, Any]], chances: Mapping[Key, Chance | None] | None = None,
                 timed_as: Mapping[tuple[str, str], tuple[str, str]] | None = None):
    """One panel per model in ``speed_rows``: each kernel's whole-model forward time relative to softmax (the
    interleaved benchmark) against its score in the model's first perplexity column (else its first scored
    column); a model without scores gets bars of the time ratios. ``timed_as`` maps further table rows onto a
    timed (model, kernel) (a converted model runs its base model's kernel): drawn hollow in that panel. None
    without any timing."""
    import matplotlib.pyplot as plt

    chances = chances or {}
    timed_as = timed_as or {}
    ratio = {(r["model"], r["kernel"]): r["ratio_vs_softmax"] for r in speed_rows
             if r.get("status") == "ok" and r.get("ratio_vs_softmax")}
    models = list(dict.fromkeys(m for m, _ in ratio))
    if not models:
        return None
    kernels = list(dict.fromkeys(k for _, k in ratio))
    tab20 = plt.get_cmap("tab20")  # the 10 strong colours first, then their light variants; markers differ too
    colour = {k: tab20((2 * i) % 20 + (i // 10) % 2) for i, k in enumerate(kernels)}
    marker = {k: MARKERS[i % len(MARKERS)] for i, k in enumerate(kernels)}
    length = next((r["length"] for r in speed_rows if r.get("length")), "?")
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.2), squeeze=False)
    chance_drawn = False
    for ax, model in zip(axes[0], models, strict=True):
        timed = [(model, k) for k in kernels if (model, k) in ratio]
        extra = [(row, timed_as[row]) for row in rows if row not in timed and timed_as.get(row) in ratio
                 and timed_as[row][0] == model]
        column = _quality_column([*timed, *(row for row, _ in extra)], columns, cell)
        ax.set_title(model, fontsize=10)
        ax.grid(alpha=0.3)
        if column is None:  # timed but not scored: the time ratios alone
            ax.bar(range(len(timed)), [ratio[key] for key in timed], color=[colour[k] for _, k in timed])
            ax.set_xticks(range(len(timed)), [k for _, k in timed], rotation=30, ha="right", fontsize=8)
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_ylabel(f"forward time / softmax's ({length} tokens)")
            ax.set_xlabel("kernel (no quality score)")
            continue
        points = [(key, ratio[key], key[1], False) for key in timed]
        points += [(row, ratio[base], base[1], True) for row, base in extra]
        metric, lower = "", False
        for key, x, kernel, hollow in points:
            r = cell.get((*key, column))
            if r is None:
                continue
            metric, lower = r["metric"], lower_is_better(r.get("task", column), r["metric"])
            ax.scatter(x, r["value"], s=46, marker=marker[kernel], color=colour[kernel],
                       facecolors="none" if hollow else colour[kernel], linewidths=1.5, zorder=3)
            ax.annotate(key[0] if hollow else kernel, (x, r["value"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        levels = [c for key, *_ in points if (c := chances.get((*key, column))) is not None]
        if levels:
            ax.axhline(max(c.threshold for c in levels), color=CHANCE_EDGE, ls=":", lw=1.2)
            chance_drawn = True
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel(f"forward time / softmax's (batch 1, {length} tokens)")
        better = "lower" if lower else "higher"
        ax.set_ylabel(f"{column} {metric} ({better} is better)")
        if metric == "perplexity":
            ax.set_yscale("log")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=marker[k], ls="", color=colour[k], label=k) for k in kernels]
    if timed_as:
        handles.append(Line2D([], [], marker="o", ls="", color="0.4", markerfacecolor="none",
                              label="converted model\n(timed as its kernel)"))
    handles.append(Line2D([], [], color="k", lw=0.8, ls="--", label="softmax's time"))
    if chance_drawn:
        handles.append(Line2D([], [], color=CHANCE_EDGE, ls=":", lw=1.2, label="chance + 1 standard error"))
    fig.legend(handles=handles, title="kernel", loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(f"Quality vs whole-model forward time (interleaved benchmark, batch 1 × {length} tokens)")
    fig.tight_layout()
    return fig


def write_plots(out: Path, rows: Sequence[tuple[str, str]], columns: Sequence[str],
                cell: Mapping[Key, dict[str, Any]], chances: Mapping[Key, Chance | None],
                speed_rows: Sequence[dict[str, Any]] = (),
                timed_as: Mapping[tuple[str, str], tuple[str, str]] | None = None) -> list[Path]:
    """Write the heat map and (with timings) the speed plot into ``out``; the paths written (none without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'hf_kernel_attn[bench]')", flush=True)
        return []
    written = []
    fig = heatmap_figure(rows, columns, cell, chances)
    fig.savefig(out / HEATMAP_FILE, dpi=90, bbox_inches="tight")
    plt.close(fig)
    written.append(out / HEATMAP_FILE)
    fig = speed_figure(rows, columns, cell, speed_rows, chances, timed_as)
    if fig is not None:
        fig.savefig(out / SPEED_PLOT_FILE, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(out / SPEED_PLOT_FILE)
    return written
