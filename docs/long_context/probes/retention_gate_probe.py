"""Where a learned retention gate ranks a niah needle (docs/long_context.md, "A learned retention score").

    python docs/long_context/probes/retention_gate_probe.py --model MODEL_WITH_SLOTS --data-dir ../shared/data \
        [--length 1024] [--depth 0.5]

A needle sentence in the niah task's wording is placed in WikiText-2 validation text; one forward with the full
cache off (use_cache=False) records each layer's ln β from the gate, and for every fifth layer and KV head the rank,
at the prompt's end, of the needle's best token among the keys outside the window by the slots' score
(t - p) ln β. A rank below the slot count C means the needle would be held."""

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
            found[i] = (mod.retention_gate(args_[1], args_[2]).detach()[0], mod.options.window)

        kernel.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    n = len(ids)
    for i in range(0, len(found), 5):
        log_beta, window = found[i]
        score = (n - torch.arange(n))[None] * log_beta
        score[:, torch.arange(n) > n - window] = float("-inf")  # still inside the window
        ranks = [int((score[h] > score[h, cut:cut + len(needle)].max()).sum()) for h in range(score.shape[0])]
        print(f"layer {i:2d}: needle ln β {log_beta[:, cut:cut + len(needle)].mean():.2e}, others "
              f"{log_beta.mean():.2e}; the needle's best rank per KV head {ranks}")


if __name__ == "__main__":
    main()
