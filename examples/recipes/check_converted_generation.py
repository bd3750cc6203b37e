"""Cached generation = recomputation for a saved converted model, with the kernel options it was saved with
(exact softmax heads, sinks, window): greedy decoding from a long prompt with ``generate``'s cache vs recomputing
the whole sequence at every step (``use_cache=False``). Appends one JSON line per model.

    python examples/recipes/check_converted_generation.py --model outputs/RUN/final [--prompt-tokens 2048]
        [--new-tokens 32] [--data-dir ../shared/data] [--output docs/results/recall/cached-generation.jsonl]

The prompt is the first ``--prompt-tokens`` tokens of WikiText-2's validation text (wiki.valid.raw).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kernel_attn  # noqa: F401  (registers the kernels a saved model names)
from hf_kernel_attn.speed.decoding import compare_with_recomputation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", default=None, help="name of the record (default: the model folder)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = (Path(args.data_dir) / "wikitext-2-raw" / "wiki.valid.raw").read_text()
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(text[: 20 * args.prompt_tokens], return_tensors="pt").input_ids[:, : args.prompt_tokens]
    if ids.shape[1] < args.prompt_tokens:
        raise ValueError(f"the text gives only {ids.shape[1]} tokens, fewer than --prompt-tokens {args.prompt_tokens}")
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    saved = getattr(model.config, "kernel_attention", None) or {}
    kernel_config = {k: saved.get(k) for k in ("kernel", "params", "layers")}
    start = time.perf_counter()
    row = compare_with_recomputation(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                     args.new_tokens)
    row = {"name": args.name or Path(args.model).resolve().parent.name, "model": args.model,
           "prompt_tokens": args.prompt_tokens, **row, "kernel_config": kernel_config,
           "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(row, default=str), flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


if __name__ == "__main__":
    main()
