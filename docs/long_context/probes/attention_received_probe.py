"""Would a score from attention keep niah's needle in the sparse cache? For each prompt (the eval task's
own, seed 0, first sample of the cell) and each of the given layers, per KV head, a score of every key, blind to
the question, and the rank of each of the needle value's digit tokens among the non-sink keys that left the window
before the question (a digit ranked below C would be kept by that score with C slots). Attention is softmax over
the sinks and the window, as a budgeted retrieval layer computes it without a cache, summed over the KV head's
query heads. ``--score``:

* ``received``: the attention each key receives from the W queries after it, while in their window (H2O-style:
  Zhang et al. 2023, "H2O: Heavy-Hitter Oracle");
* ``instruction``: the attention the key's own query puts on the prompt's opening instruction (the sinks from
  ``--instruction-from`` on, past the first tokens that every query attends to): a token that refers to what the
  opening asks to remember.

    python docs/long_context/probes/attention_received_probe.py --model outputs/rl16-s40-c84-o84 --task niah \
        --cells 1024@25 2048@50 4096@50 --output docs/results/recall/attention-received-probe-niah.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hf_kernel_attn.evaluation.runner import ModelSpec
from hf_kernel_attn.integration.transfer import attention_probe

sys.dont_write_bytecode = True  # no __pycache__ under docs/ (tests/test_doc_links.py names every file here)
from probe_common import probe_prompts  # noqa: E402  (beside this script)

RETRIEVAL16 = [18, 17, 7, 8, 21, 23, 14, 15, 20, 5, 6, 19, 2, 24, 22, 26]


def window_weights(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int, sinks: int):
    """Per KV head, ``[G, N, N]``: softmax_{sinks ∪ window(i)}(s q_i·k_j) of its G query heads (``q`` ``[Hq, N, D]``,
    ``k`` ``[Hkv, N, D]``)."""
    hq, n, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = (j <= i) & ((i - j < window) | (j < sinks))
    for h in range(hkv):
        yield ((q[h * g:(h + 1) * g] @ k[h].T) * scaling).masked_fill(~visible, float("-inf")).softmax(-1)


def received_in_window(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int, sinks: int,
                       before: int) -> torch.Tensor:
    """``[Hkv, N]``: Σ over queries i < ``before`` with j < i < j + W, and over the KV head's query heads, of
    the window weight of key j."""
    n = q.shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    counted = (j < i) & (i - j < window) & (i < before)
    return torch.stack([(w * counted).sum((0, 1)) for w in window_weights(q, k, scaling, window, sinks)])


def on_instruction(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int, sinks: int,
                   start: int) -> torch.Tensor:
    """``[Hkv, N]``: Σ over the KV head's query heads of the window weight query j puts on the sinks
    ``start`` … S - 1."""
    return torch.stack([w[:, :, start:sinks].sum((0, 2)) for w in window_weights(q, k, scaling, window, sinks)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="niah", choices=["passkey", "niah"])
    p.add_argument("--score", default="received", choices=["received", "instruction"])
    p.add_argument("--instruction-from", type=int, default=4, help="instruction score: the first sink counted")
    p.add_argument("--cells", nargs="+", default=["1024@25", "2048@50"], help="LENGTH@DEPTH")
    p.add_argument("--layers", type=int, nargs="+", default=RETRIEVAL16)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=40)
    p.add_argument("--capacity", type=int, default=84, help="C: a digit ranked below it would be kept")
    p.add_argument("--question-tokens", type=int, default=40, help="the prompt's last tokens, taken as the question")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = ModelSpec(args.model, None, None, None, {}).load("causal_lm")

    prompt = probe_prompts(args.task, tok, args.data_dir)
    rows = []
    for cell in args.cells:
        length, depth = (int(x) for x in cell.split("@"))
        sample, _, digit_set = prompt(length, depth)
        key = sample.answers[0]
        digits = sorted(digit_set)
        captured: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

        def keep(layer, q, k, mask, causal, scaling, value=None, captured=captured):
            if layer in args.layers:
                captured[layer] = (q[0].float(), k[0].float(), scaling)

        ids = torch.tensor([sample.ids])
        with torch.no_grad(), attention_probe(keep):
            model(ids, use_cache=False)
        n = ids.shape[1]
        before = n - args.question_tokens
        candidates = torch.arange(args.sinks, before - args.window)
        ranks, held = {}, {}
        for layer in args.layers:
            q, k, scaling = captured[layer]
            received = (received_in_window(q, k, scaling, args.window, args.sinks, before) if args.score == "received"
                        else on_instruction(q, k, scaling, args.window, args.sinks, args.instruction_from))
            layer_ranks = []
            for h in range(received.shape[0]):
                order = received[h, candidates].argsort(descending=True).tolist()
                rank = {int(candidates[o]): r for r, o in enumerate(order)}
                layer_ranks.append([rank.get(d, -1) for d in digits])
            ranks[layer] = layer_ranks
            held[layer] = sum(1 for head in layer_ranks for r in head if 0 <= r < args.capacity)
        row = {"task": args.task, "length": length, "depth": depth, "key": key, "digit_tokens": len(digits),
               "candidates": len(candidates), "kv_heads": len(ranks[args.layers[0]]),
               "digit_pairs_in_top_capacity_by_layer": held, "digit_ranks_by_layer": ranks}
        print(json.dumps({k: v for k, v in row.items() if k != "digit_ranks_by_layer"}), flush=True)
        rows.append(row)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "score": args.score, "instruction_from": args.instruction_from,
                       "window": args.window, "sinks": args.sinks, "capacity": args.capacity,
                       "question_tokens": args.question_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
