"""Where a learned retention gate ranks a niah needle (docs/long_context.md, "A learned retention score").

    python docs/long_context/probes/retention_gate_probe.py --model MODEL_WITH_SLOTS --data-dir ../shared/data \
        [--length 1024] [--depth 0.5]

A needle sentence in the niah task's wording is placed in WikiText-2 validation text; one forward with the full
cache off (use_cache=False) records each layer's ln β from the gate, and for every fifth layer (``--every``) and
KV head the rank, at the prompt's end, of the needle's best token among the keys outside the window and the sinks
by the slots' score ((t - p) ln β, or ln β with retention_decay false), and how many of the needle's tokens are
among the C best (``docs/long_context/probes/needle_oracle_probe.py``: SmolLM2 answers when the slots hold the
whole needle sentence, not when they hold only its number)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kernel_attn  # noqa: F401  (registers the kernels)

NEEDLE = " One of the special magic numbers for brave-lion is: 7319264."
QUESTION = ("\nWhat is the special magic number for brave-lion mentioned in the provided text? The special magic "
            "number for brave-lion mentioned in the provided text is")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data-dir", required=True, type=Path)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--every", type=int, default=5, help="print every N-th layer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    hay = tok((args.data_dir / "wikitext-2-raw" / "wiki.valid.raw").read_text()[:60000]).input_ids
    needle, question = tok(NEEDLE).input_ids, tok(QUESTION).input_ids
    body = args.length - len(needle) - len(question)
    cut = int(body * args.depth)
    ids = hay[:cut] + needle + hay[cut:body] + question
    found: dict[int, tuple[torch.Tensor, int]] = {}
    for i, layer in enumerate(model.model.layers):
        kernel = layer.self_attn.kernel_attn

        def hook(mod, args_, kwargs, i=i):
            found[i] = (mod.retention_gate(args_[1], args_[2]).detach()[0], mod.options)

        kernel.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    n = len(ids)
    span = slice(cut, cut + len(needle))
    for i in range(0, len(found), args.every):
        log_beta, options = found[i]
        score = (n - torch.arange(n))[None] * log_beta if options.retention_decay else log_beta.clone()
        score[:, torch.arange(n) > n - options.window] = float("-inf")  # still inside the window
        score[:, :options.sinks] = float("-inf")  # sinks are held anyway
        ranks = [int((score[h] > score[h, span].max()).sum()) for h in range(score.shape[0])]
        held = [int((score[h, span] >= score[h].topk(options.slots).values[-1]).sum()) for h in range(score.shape[0])]
        print(f"layer {i:2d}: needle ln β {log_beta[:, span].mean():.2e}, others {log_beta.mean():.2e}; the "
              f"needle's best rank per KV head {ranks}; needle tokens held {held} of {len(needle)}")


if __name__ == "__main__":
    main()
