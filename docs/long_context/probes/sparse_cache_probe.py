"""Does the sparse cache hold the passkey, and does the model read it? For passkey prompts (the eval
task's own prompts, seed 0, first sample of each cell), after the prompt: how many of the needle's digit pairs
each layer's sparse cache holds (out of digits x KV heads), how many of all the needle's pairs (its words too),
and the greedy answer with the cache, and with the
linear branch switched off (window + sinks + the cached pairs attended exactly, λ = 0).

    python docs/long_context/probes/sparse_cache_probe.py --model outputs/smollm2-hedgehog-sinks-window64-recall/final \
        --param sparse_cache=100 --param sparse_block=8 --cells 2048@0 2048@25 4096@25 1024@0 \
        --output docs/results/recall/sparse-cache-probe.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hf_kernel_attn.evaluation.runner import ModelSpec
from hf_kernel_attn.integration.branches import hybrid_layers, linear_branch_off
from hf_kernel_attn.integration.cache import new_cache
from hf_kernel_attn.kernel_args import parse_params

sys.dont_write_bytecode = True  # no __pycache__ under docs/ (tests/test_doc_links.py names every file here)
from probe_common import probe_prompts  # noqa: E402  (beside this script)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--param", action="append", default=[], help="KEY=VALUE option of the saved kernel")
    p.add_argument("--cells", nargs="+", default=["2048@0", "2048@25", "4096@25", "1024@0"],
                   help="LENGTH@DEPTH or LENGTH@DEPTH#SAMPLE (the eval's SAMPLE-th prompt of that cell, from 0)")
    p.add_argument("--linear-off-layers", type=int, nargs="*", default=[],
                   help="these layers run with their linear branch switched off throughout (λ = 0)")
    p.add_argument("--task", default="passkey", choices=["passkey", "niah"],
                   help="niah: the natural-text needle (needs --data-dir; its value's digits are counted)")
    p.add_argument("--data-dir", default="../shared/data", help="niah's filler text (WikiText-2 validation)")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = ModelSpec(args.model, None, None, None, parse_params(args.param).get(None, {})).load("causal_lm")

    layers = hybrid_layers(model)
    for i in args.linear_off_layers:
        layers[i].linear_branch_off = True

    prompt = probe_prompts(args.task, tok, args.data_dir)
    rows = []
    for cell in args.cells:
        where, _, index = cell.partition("#")
        length, depth = (int(x) for x in where.split("@"))
        index = int(index or 0)
        sample, span, digits = prompt(length, depth, index)
        key = sample.answers[0]
        ids = torch.tensor([sample.ids])
        cache = new_cache(model)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            answer = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
            with linear_branch_off(model):
                answer_off = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
        held, held_all = [], []
        for layer in cache.layers:
            sc = layer.state.sparse
            kept = [{int(p) for p, ok in zip(sc.pos[0, h], sc.valid[0, h], strict=True) if ok}
                    for h in range(sc.pos.shape[1])]
            held.append(sum(len(k & digits) for k in kept))
            held_all.append(sum(len(k & set(span)) for k in kept))
        row = {"task": args.task, "length": length, "depth": depth, "sample": index, "key": key,
               "digit_tokens": len(digits),
               "needle_tokens": len(span), "kv_heads": int(cache.layers[0].state.sparse.pos.shape[1]),
               "digit_pairs_held_by_layer": held, "needle_pairs_held_by_layer": held_all,
               "answer": answer, "answer_linear_branch_off": answer_off}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "params": args.param, "linear_off_layers": args.linear_off_layers,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
