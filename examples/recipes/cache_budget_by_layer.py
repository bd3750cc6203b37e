"""Spend a sparse-cache budget where the model retrieves: a copy of a converted model whose layers get different
``sparse_cache`` sizes, the same total number of cached pairs as ``--average`` pairs in every layer.

Each layer's retrieval score is the largest, over its query heads, attention probability that the original
softmax model puts on a stated fact while the answer is produced (:func:`head_retrieval_scores`; Wu et al. 2024,
"Retrieval Head Mechanistically Explains Long-Context Factuality"), measured on training text with recall facts
inserted (``training.recall_data``; the evaluation tasks' wording and text are never used). The ``--layers``
best-scoring layers share the budget equally, the others keep no cache: the decode cache has the bytes of
``sparse_cache=AVERAGE`` in every layer, and it still does not grow with the context.

    python examples/recipes/cache_budget_by_layer.py --model outputs/smollm2-hedgehog-sinks-window64-recall/final \\
        --average 64 --layers 8 --output outputs/hh-sinks-budget-l8
    bash examples/recipes/recall_eval.sh NAME outputs/hh-sinks-budget-l8

Retrieval layers on a budget: ``--retrieval-cache C`` gives the chosen layers C pairs and
``--other-cache C'`` every other layer C' (instead of sharing ``--average``); ``--retrieval-softmax`` makes every
query head of a chosen layer a retrieval head on a budget (softmax over its sinks, window and cached pairs, no
linear part: the state only scores the pairs); ``--retrieval-sinks S`` keeps the prompt's first S tokens (an
instruction, say) exact in those layers; ``--choose`` names the layers instead of the best-scoring ones:

    python examples/recipes/cache_budget_by_layer.py --model outputs/smollm2-hedgehog-sinks-window64-recall/final \
        --choose 7 8 14 15 17 18 21 23 --retrieval-cache 100 --other-cache 92 --retrieval-sinks 40 \
        --retrieval-softmax --sparse-block 8 --output outputs/rl8-s40-c100-o92

The copy links the weights and writes its own config.json (``kernel_attention.layers`` with per-layer options)
and ``cache_budget.json`` (the scores and the allocation). The same per-layer options are what a training
config's ``inference_layers`` adds to the model it saves.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer

import hf_kernel_attn
from hf_kernel_attn.integration.layer_choice import head_retrieval_scores
from hf_kernel_attn.training.recall_data import recall_block_spans, recall_span_targets


def calibration(tokenizer, files: list[Path], blocks: int, seq_len: int, seed: int):
    """``blocks`` rows of ``seq_len`` training tokens with recall facts, and their retrieval targets."""
    ids: list[int] = []
    for f in files:
        ids += tokenizer(f.read_text(encoding="utf-8")[:200_000], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    batches, targets = [], []
    for _ in range(blocks):
        start = rng.randrange(0, len(ids) - seq_len)
        row, spans = recall_block_spans(ids[start:start + seq_len], lambda t: tokenizer(
            t, add_special_tokens=False)["input_ids"], rng, max_facts=4)
        batches.append({"input_ids": torch.tensor([row])})
        targets.append([recall_span_targets(spans)])
    return batches, targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a converted model folder (window hybrid)")
    ap.add_argument("--average", type=int, default=64, help="pairs per KV head per layer on average")
    ap.add_argument("--layers", type=int, default=8, help="how many of the best-scoring layers hold a cache")
    ap.add_argument("--retrieval-cache", type=int, default=None,
                    help="sparse_cache of the chosen layers (instead of sharing --average among them)")
    ap.add_argument("--other-cache", type=int, default=0, help="sparse_cache of the other layers (with "
                    "--retrieval-cache; default 0)")
    ap.add_argument("--retrieval-sinks", type=int, default=None, help="sinks of the chosen layers (default: the "
                    "model's): the prompt's first tokens, e.g. an instruction, attended exactly")
    ap.add_argument("--retrieval-softmax", action="store_true", help="every query head of the chosen layers is a "
                    "retrieval head on a budget: softmax over sinks, window and cached pairs, no linear part")
    ap.add_argument("--sparse-block", type=int, default=None, help="sparse_block of every cached layer")
    ap.add_argument("--choose", type=int, nargs="+", default=None, help="these layers instead of the best-scoring")
    ap.add_argument("--data", nargs="+", type=Path, default=[Path("../shared/data/tinyshakespeare/train.txt"),
                                                             Path("../shared/data/ptb/ptb.valid.txt")])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True, type=Path)
    args = ap.parse_args()

    torch.set_num_threads(1)
    model = hf_kernel_attn.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    batches, targets = calibration(tokenizer, args.data, args.blocks, args.seq_len, args.seed)
    scores = head_retrieval_scores(model, batches, targets)
    layer_score = {layer: max(row) for layer, row in scores.items()}
    n_layers = len(layer_score)
    if not 0 < args.layers <= n_layers:
        raise SystemExit(f"--layers must be 1..{n_layers} (the model's attention layers), got {args.layers}")
    chosen = sorted(args.choose or sorted(layer_score, key=lambda i: -layer_score[i])[:args.layers])
    if any(not 0 <= i < n_layers for i in chosen):
        raise SystemExit(f"--choose: layer indices 0..{n_layers - 1}, got {args.choose}")
    per_layer = args.average * n_layers // len(chosen) if args.retrieval_cache is None else args.retrieval_cache
    others = 0 if args.retrieval_cache is None else args.other_cache

    config = json.loads((args.model / "config.json").read_text())
    kcfg = config["kernel_attention"]
    params = {k: v for k, v in kcfg["params"].items() if k != "sparse_cache"}
    block = {} if args.sparse_block is None else {"sparse_block": args.sparse_block}
    kcfg["params"] = {**params, "sparse_cache": others, **block} if others else params
    special = {"sparse_cache": per_layer, **block}
    if args.retrieval_sinks is not None:
        special["sinks"] = args.retrieval_sinks
    if args.retrieval_softmax:
        special["softmax_heads"] = list(range(model.config.num_attention_heads))
    kcfg["layers"] = {str(i): {"kernel": kcfg["kernel"], "params": {**params, **special}} for i in chosen}
    args.output.mkdir(parents=True, exist_ok=True)
    for f in args.model.iterdir():
        target = args.output / f.name
        if f.name in ("config.json", "README.md") or target.exists():
            continue
        if f.suffix == ".safetensors":
            target.symlink_to(f.resolve())
        else:
            shutil.copy2(f, target)
    (args.output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    record = {"source": str(args.model), "average": args.average, "layers": chosen, "sparse_cache": per_layer,
              "other_layers_sparse_cache": others, "chosen_layer_params": special,
              "layer_scores": {str(i): round(s, 5) for i, s in sorted(layer_score.items())},
              "calibration_blocks": args.blocks, "seq_len": args.seq_len}
    (args.output / "cache_budget.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "layer_scores"}))
    print("layer scores:", " ".join(f"{i}:{s:.3f}" for i, s in sorted(layer_score.items())))


if __name__ == "__main__":
    main()
