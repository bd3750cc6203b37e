"""Acceptance measurements of the recurrent-state cache on SmolLM2-135M-Instruct (a normal checkpoint folder,
e.g. from `hf-kernel-attn convert-gguf`): greedy generation with the recurrent-state cache vs full
recomputation, cache bytes after 64 and 1,024 tokens, and a hybrid model. Prints one line per check; writes JSON.

    python scripts/check_generation.py --model CHECKPOINT [--new-tokens 64] [--output results.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS
from hf_kernel_attn.speed.decoding import cache_bytes_after, compare_with_recomputation

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived", "Hi"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kernels", nargs="+", default=sorted(n for n, c in KERNELS.items() if c.is_linear))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    results = []

    def report(name, **row):
        results.append({"check": name, **row})
        print(name, json.dumps(row), flush=True)

    for dtype in args.dtypes:
        model.to(getattr(torch, dtype))
        for kernel in args.kernels:
            hf_kernel_attn.patch(model, kernel=kernel)
            report("generate_vs_recompute", kernel=kernel, dtype=dtype,
                   **compare_with_recomputation(model, batch, args.new_tokens))
        hf_kernel_attn.patch(model, kernel="hedgehog", layers={0: "softmax", -1: "softmax"})
        report("hybrid_generate_vs_recompute", kernel="softmax|hedgehog×28|softmax", dtype=dtype,
               **compare_with_recomputation(model, batch, args.new_tokens))
    model.float()
    for kernel in args.kernels:
        hf_kernel_attn.patch(model, kernel=kernel)
        sizes = {n: cache_bytes_after(model, batch["input_ids"][:1], n) for n in (64, 1024)}
        report("cache_bytes", kernel=kernel, after_64=sizes[64], after_1024=sizes[1024])
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
