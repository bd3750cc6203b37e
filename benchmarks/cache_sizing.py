"""What a bounded cache's configured size costs before it is filled: peak memory and prefill time of a short prompt
against the sparse cache's slot count C (docs/benchmarks.md, "Cache size and cost").

The model is patched in memory (hedgehog, window 64, 4 sinks, sparse_block 8; untrained weights cost the same as
converted ones) once per C; each round runs every C once (interleaved, one thread), and each run is a
``use_cache=True`` forward of the prompt followed by a greedy generate of ``--new`` tokens. Peak memory is the
process's resident-set high-water mark (VmHWM, reset before each run through /proc/self/clear_refs) minus the
resident set before the run.

    python benchmarks/cache_sizing.py --model smollm2 --capacities 64 2000 20000 --prompts 5 120 \
        --output docs/results/cache-sizing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import hf_kernel_attn
from hf_kernel_attn.integration.cache import cache_bytes

PRESET = {"window": 64, "sinks": 4, "sparse_block": 8}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def measure(model, prompt: int, new: int) -> dict[str, float]:
    """One run: prefill seconds, total seconds, peak MB above the resident set before, cache bytes after the
    prompt."""
    ids = torch.randint(100, 20000, (1, prompt), generator=torch.Generator().manual_seed(0))
    _reset_peak()
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - start
        held = cache_bytes(out.past_key_values)
        del out
        model.generate(ids, max_new_tokens=new, do_sample=False)
    total = time.perf_counter() - start
    return {"prefill_s": prefill, "total_s": total, "peak_mb": (_status_kb("VmHWM") - before) / 1024,
            "cache_bytes": held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a (softmax) checkpoint folder, e.g. the converted SmolLM2")
    parser.add_argument("--capacities", type=int, nargs="+", default=[64, 2000, 20000])
    parser.add_argument("--prompts", type=int, nargs="+", default=[5, 120])
    parser.add_argument("--new", type=int, default=8, help="greedy tokens after the prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = {c: hf_kernel_attn.from_pretrained(args.model, kernel="hedgehog", sparse_cache=c, **PRESET).eval()
              for c in args.capacities}
    runs: dict[tuple[int, int], list[dict[str, float]]] = {(c, p): [] for c in args.capacities for p in args.prompts}
    for c in args.capacities:  # warm-up: first calls allocate the allocator's pools and import lazily
        measure(models[c], args.prompts[0], 1)
    for _ in range(args.rounds):
        for p in args.prompts:
            for c in args.capacities:
                runs[(c, p)].append(measure(models[c], p, args.new))
    rows = []
    for p in args.prompts:
        base = statistics.median(r["prefill_s"] for r in runs[(args.capacities[0], p)])
        base_peak = max(r["peak_mb"] for r in runs[(args.capacities[0], p)])
        for c in args.capacities:
            rs = runs[(c, p)]
            prefill = statistics.median(r["prefill_s"] for r in rs)
            peak = max(r["peak_mb"] for r in rs)
            rows.append({"sparse_cache": c, "prompt": p, "prefill_s": prefill, "prefill_ratio": prefill / base,
                         "total_s": statistics.median(r["total_s"] for r in rs), "peak_mb": peak,
                         "peak_mb_over_first": peak - base_peak, "cache_bytes": rs[0]["cache_bytes"]})
    print("| prompt | sparse_cache | prefill s (median) | × first C | prompt + generate s | peak MB | "
          "cache bytes after prompt |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['sparse_cache']:,} | {r['prefill_s']:.3f} | {r['prefill_ratio']:.2f} | "
              f"{r['total_s']:.2f} | {r['peak_mb']:.0f} | {r['cache_bytes']:,} |")
    if args.output:
        meta = {"command": " ".join(sys.argv), "torch": torch.__version__, "preset": PRESET, "rounds": args.rounds,
                "new_tokens": args.new, "threads": 1}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
