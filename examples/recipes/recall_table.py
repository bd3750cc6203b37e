"""The recall comparison table from docs/results/recall/*.jsonl (written by examples/recipes/recall_eval.sh) and
docs/results/recall/cache-bytes.jsonl (examples/recipes/decode_cache_bytes.py; a record's optional "name" is the row it
belongs to, else its model folder's parent): one markdown row per model.

    python examples/recipes/recall_table.py [--dir docs/results/recall] [--rows softmax gaussian-ce ...] [--niah]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = [("wikitext2", "perplexity", None, "WikiText-2 ppl"), ("arc_easy", "acc_norm", None, "ARC-Easy"),
           ("lambada_openai", "acc", None, "LAMBADA"), ("passkey", "exact_match", 1024, "passkey 1k"),
           ("passkey", "exact_match", 2048, "passkey 2k"), ("passkey", "exact_match", 4096, "passkey 4k")]
NIAH_COLUMNS = [("niah", "exact_match", 1024, "niah 1k"), ("niah", "exact_match", 2048, "niah 2k"),
                ("niah", "exact_match", 4096, "niah 4k"),
                ("niah", "exact_match_multikey", 1024, "multi-key 1k"),
                ("niah", "exact_match_multikey", 2048, "multi-key 2k"),
                ("niah", "exact_match_multikey", 4096, "multi-key 4k"),
                ("passkey", "exact_match", 8192, "passkey 8k")]


def load(folder: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(folder.glob("*.jsonl")):
        if path.name not in ("cache-bytes.jsonl", "cached-generation.jsonl"):
            out[path.stem] = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return out


def cell(records: list[dict], task: str, metric: str, length: int | None) -> str:
    rows = [r for r in records if r["task"] == task and r["metric"] == metric
            and (length is None or r.get("length") == length)]
    if not rows:
        return "–"
    if task in ("passkey", "niah"):  # mean over depths, percent
        n = sum(r["n"] for r in rows)
        return f"{sum(r['value'] * r['n'] for r in rows) / n:.0f}% ({n})"
    value = rows[-1]["value"]
    return f"{value:.2f}" if metric == "perplexity" else f"{100 * value:.1f}"


def cache_after(records: list[dict], length: int) -> str:
    """The decode cache after a prompt of ``length`` tokens, as the long-context records carry it (MiB)."""
    sizes = {r["cache_bytes"] for r in records if r.get("length") == length and r.get("cache_bytes") is not None
             and r["task"] in ("passkey", "niah")}
    return "–" if not sizes else " / ".join(f"{b / 2**20:.1f} MiB" for b in sorted(sizes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="docs/results/recall")
    ap.add_argument("--rows", nargs="*", default=None, help="file stems in this order (default: all)")
    ap.add_argument("--niah", action="store_true", help="add the niah columns (single and multi-key), passkey at 8k "
                                                        "and the cache after 4k tokens as the records carry it")
    args = ap.parse_args()
    columns = COLUMNS + NIAH_COLUMNS if args.niah else COLUMNS
    folder = Path(args.dir)
    data = load(folder)
    cache = {}
    cache_path = folder / "cache-bytes.jsonl"
    if cache_path.exists():
        for ln in cache_path.read_text().splitlines():
            r = json.loads(ln)
            cache[r.get("name") or Path(r["model"]).parent.name] = r  # "name": the row it belongs to
    header = ["model", *[c[3] for c in columns], "cache after 4k / softmax KV"]
    if args.niah:
        header.append("cache after 4k (records)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in args.rows or sorted(data):
        records = data.get(name, [])
        c = next((v for k, v in cache.items() if k.endswith(name)), None)
        ratio = f"{100 * c['ratio']:.1f}%" if c else "–"
        row = [name, *[cell(records, *col[:3]) for col in columns], ratio]
        if args.niah:
            row.append(cache_after(records, 4096))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
