"""Markdown tables for docs/long_context.md from a long-context leaderboard's results.jsonl:
per row, accuracy by length (mean over depths, and min over depths), the length × depth grid of each row, and
the loss by position bucket.

    python examples/recipes/long_context_tables.py outputs/leaderboard-long-context/results.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    recs = [json.loads(ln) for ln in open(path) if ln.strip()]
    rows = list(dict.fromkeys((r["model_name"], r["kernel_row"]) for r in recs))
    for task, metric in sorted({(r["task"], r["metric"]) for r in recs if r["task"] != "position_loss"}):
        cells = defaultdict(dict)
        for r in recs:
            if (r["task"], r["metric"]) == (task, metric):
                cells[(r["model_name"], r["kernel_row"])][(r["length"], r["depth"])] = r
        lengths = sorted({k[0] for c in cells.values() for k in c})
        depths = sorted({k[1] for c in cells.values() for k in c})
        print(f"\n### {task} {metric}: mean over depths {depths} (min over depths), n per cell\n")
        print("| model | kernel | " + " | ".join(f"{n}" for n in lengths) + " |")
        print("|---|---|" + "---|" * len(lengths))
        for row in rows:
            if row not in cells:
                continue
            parts = []
            for n in lengths:
                vals = [cells[row][(n, d)]["value"] for d in depths if (n, d) in cells[row]]
                parts.append(f"{sum(vals) / len(vals):.0f} ({min(vals):.0f})" if vals else "–")
            print(f"| {row[0]} | {row[1]} | " + " | ".join(parts) + " |")
        print(f"\n{task} {metric} by depth (rows: model / kernel @ length; columns: depth %)\n")
        print("| row | " + " | ".join(f"{d:g}" for d in depths) + " |")
        print("|---|" + "---|" * len(depths))
        for row in rows:
            for n in lengths:
                if row in cells and any((n, d) in cells[row] for d in depths):
                    vals = [f"{cells[row][(n, d)]['value']:.0f}" if (n, d) in cells[row] else "–" for d in depths]
                    print(f"| {row[0]} / {row[1]} @ {n} | " + " | ".join(vals) + " |")
    losses = defaultdict(dict)
    for r in recs:
        if r["task"] == "position_loss":
            losses[(r["model_name"], r["kernel_row"])][(r["position_start"], r["length"])] = r["value"]
    if losses:
        spans = sorted({k for v in losses.values() for k in v})
        print("\n### position_loss: mean next-token loss (nats) by token position\n")
        print("| model | kernel | " + " | ".join(f"{a}–{b}" for a, b in spans) + " |")
        print("|---|---|" + "---|" * len(spans))
        for row in rows:
            if row in losses:
                print(f"| {row[0]} | {row[1]} | " + " | ".join(
                    f"{losses[row][s]:.3f}" if s in losses[row] else "–" for s in spans) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
