"""Loss curves of conversion runs: one PNG per run from its training_log.jsonl (one panel per stage).

    python examples/recipes/plot_training.py outputs/smollm2-gaussian [more run folders] --out docs/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(run: Path, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(ln) for ln in (run / "training_log.jsonl").read_text().splitlines() if ln.strip()]
    stages = list(dict.fromkeys(r["stage"] for r in records))
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 3.4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows = [r for r in records if r["stage"] == stage]
        x, y = [r["tokens"] / 1e3 for r in rows], [r["loss"] for r in rows]
        ax.plot(x, y, lw=0.8, alpha=0.45, label="per step")
        w = min(10, len(y))
        ax.plot(x[w - 1:], [sum(y[i - w + 1:i + 1]) / w for i in range(w - 1, len(y))], lw=1.6,
                label=f"mean of {w}")
        ax.legend(fontsize=7)
        ax.set_title(f"{run.name}: {stage}")
        ax.set_xlabel("training tokens (thousands)")
        ax.set_ylabel("Σ layer MSE" if stage == "transfer" else "loss")
        if stage == "transfer":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{run.name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    for run in args.runs:
        print(plot(run, args.out))


if __name__ == "__main__":
    main()
