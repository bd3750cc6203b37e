"""The benchmark table of docs/similarity.md from the synthetic runs' leaderboard records.

``python -m hf_kernel_attn.similarity.report RESULTS.jsonl [--output-dir DIR]`` prints (and writes
``similarity_table.md``) the mean ± sample std of held-out accuracy over seeds per kernel and setting, with
the CPU seconds per run, and renders the same records with the leaderboard's own renderer (one leaderboard
row per seed and kernel: ``leaderboard.md``, ``leaderboard.csv``, ``leaderboard_heatmap.png``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from ..fileio import read_jsonl
from ..leaderboard.render import render
from .synthetic import TRAIN_KERNELS


def read_records(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"results file {str(path)!r} does not exist")
    return [r for r in read_jsonl(path) if r.get("split") == "heldout" and "seed" in r]


def aggregate(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(setting, kernel) -> mean, std (sample, ddof 1; 0 for one seed), seeds, CPU-s mean / max."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["task"], r["kernel"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        vals = [r["value"] for r in rs]
        cpu = [r["cpu_seconds"] for r in rs]
        out[key] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                    "seeds": sorted(r["seed"] for r in rs), "values": vals, "cpu_mean": statistics.fmean(cpu),
                    "cpu_max": max(cpu), "chance": rs[0].get("chance"),
                    "context_baseline": rs[0].get("context_baseline"), "steps": rs[0].get("steps")}
    return out


def table(records: list[dict[str, Any]]) -> str:
    agg = aggregate(records)
    settings = sorted({s for s, _ in agg}, key=lambda s: (s.startswith("listops"), s != "mqar-short", s))
    kernels = [k for k in TRAIN_KERNELS if any((s, k) in agg for s in settings)]
    kernels += sorted({k for _, k in agg} - set(kernels))
    head = ["kernel", *(f"{s} acc. % (mean ± std, seeds)" for s in settings), *(f"{s} CPU-s/run" for s in settings)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in kernels:
        cells, cpus = [], []
        for s in settings:
            a = agg.get((s, k))
            cells.append("–" if a is None else f"{a['mean']:.1f} ± {a['std']:.1f} ({len(a['seeds'])})")
            cpus.append("–" if a is None else f"{a['cpu_mean']:.0f} (max {a['cpu_max']:.0f})")
        lines.append("| " + " | ".join([k, *cells, *cpus]) + " |")
    notes = []
    for s in settings:
        a = next(agg[(s, k)] for k in kernels if (s, k) in agg)
        base = (f"; one of the context's values at random: {a['context_baseline']:.1f} %"
                if a["context_baseline"] else "")
        notes.append(f"- {s}: {a['steps']} steps; uniform guess among the answers: {a['chance']:.1f} %{base}")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def render_leaderboard(records: list[dict[str, Any]], output_dir: str | Path) -> None:
    """The records through ``leaderboard.render.render`` (rows: seed × kernel, columns: settings)."""
    seeds = sorted({r["seed"] for r in records})
    settings = sorted({r["task"] for r in records})
    kernels = [k for k in TRAIN_KERNELS if any(r["kernel"] == k for r in records)]
    kernels += sorted({r["kernel"] for r in records} - set(kernels))
    cfg = {"output_dir": str(output_dir), "split": "heldout", "data_dir": "generated on the fly", "limit": None,
           "models": [{"name": f"tiny-llama seed {s}", "kernels": kernels, "tasks": settings} for s in seeds]}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    render(cfg, records, [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results.jsonl written by `hf-kernel-attn synthetic --output`")
    parser.add_argument("--output-dir", default=None, help="write similarity_table.md and the leaderboard here")
    args = parser.parse_args(argv)
    records = read_records(args.results)
    text = table(records)
    print(text)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "similarity_table.md").write_text(text)
        (out / "similarity_table.json").write_text(json.dumps(
            {f"{s}/{k}": v for (s, k), v in aggregate(records).items()}, indent=1))
        render_leaderboard(records, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
