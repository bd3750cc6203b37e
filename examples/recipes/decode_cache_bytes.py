"""Decode-cache bytes after a prefill of N tokens: a converted (or patched) model's cache against the original
softmax model's KV cache, both measured on the same random token ids.

    python examples/recipes/decode_cache_bytes.py --model outputs/smollm2-hedgehog-heads-window64-recall/final \
        --base outputs/smollm2-hedgehog-heads-window64-recall/base-model --tokens 4096 --output FILE.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

import hf_kernel_attn  # noqa: F401  (registers the kernels a converted checkpoint names)


def cache_bytes(cache) -> int:
    """Bytes held by a cache: our RecurrentStateCache reports its own; a DynamicCache is its keys and values."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def prefill_bytes(path: str, ids: torch.Tensor, attn_implementation: str | None = None) -> int:
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    out = model(ids, use_cache=True, logits_to_keep=1)
    return cache_bytes(out.past_key_values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the converted model folder (runs its saved kernel)")
    ap.add_argument("--base", required=True, help="the original model folder (softmax, SDPA)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ours = prefill_bytes(args.model, ids)
    softmax = prefill_bytes(args.base, ids, attn_implementation="sdpa")
    record = {"model": args.model, "tokens": args.tokens, "cache_bytes": ours, "softmax_kv_bytes": softmax,
              "ratio": ours / softmax}
    print(json.dumps(record))
    if args.output:
        with open(args.output, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
