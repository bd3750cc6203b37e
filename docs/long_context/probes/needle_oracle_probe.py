"""What the slots must hold for SmolLM2 to answer a niah needle (docs/long_context.md, "A learned retention score").

    python docs/long_context/probes/needle_oracle_probe.py --model SMOLLM2_FOLDER --data-dir ../shared/data \
        [--length 4096] [--depth 0.1] [--slots 128] [--hold sentence|digits|none]

SmolLM2's own softmax with 4 sinks, a 64-token window and C slots (retention_decay false), but the gate replaced by
an oracle that knows where the needle is: in the prefill the needle's tokens score 0 (``sentence``: the whole
needle sentence; ``digits``: only its number) and every other key -1, so the slots hold exactly those tokens when
they fit (ties keep the newest keys). A needle sentence in the niah task's wording sits in WikiText-2 validation
text; greedy generation of 10 tokens after the question. The answer shows whether a score that ranks the needle
first would be enough, and which of its tokens must be kept."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kernel_attn
from hf_kernel_attn.kernels.retention import RetentionGate

NEEDLE = " One of the special magic numbers for brave-lion is: 7319264."
QUESTION = ("\nWhat is the special magic number for brave-lion mentioned in the provided text? The special magic "
            "number for brave-lion mentioned in the provided text is")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct folder (hf-kernel-attn convert-gguf)")
    ap.add_argument("--data-dir", required=True, type=Path)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depth", type=float, default=0.1)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--hold", choices=["sentence", "digits", "none"], default="sentence")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    hf_kernel_attn.patch(model, kernel="softmax", window=64, sinks=4, slots=args.slots, retention_block=32,
                         retention_decay=False)
    hay = tok((args.data_dir / "wikitext-2-raw" / "wiki.valid.raw").read_text()[:80000]).input_ids
    needle, question = tok(NEEDLE).input_ids, tok(QUESTION).input_ids
    body = args.length - len(needle) - len(question)
    cut = int(body * args.depth)
    ids = hay[:cut] + needle + hay[cut:body] + question
    held = torch.zeros(len(ids), dtype=torch.bool)
    if args.hold == "sentence":
        held[cut:cut + len(needle)] = True
    elif args.hold == "digits":
        digits = [i for i, t in enumerate(needle) if tok.decode([t]).strip().isdigit()]
        held[[cut + i for i in digits]] = True

    def oracle(gate: RetentionGate, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        score = torch.full(k.shape[:-1], -1.0)
        if k.shape[-2] == len(ids):  # the prefill; decoded tokens score -1
            score[..., held] = 0.0
        return score

    RetentionGate.forward = oracle
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, len(ids):])
    print(f"hold {args.hold} ({int(held.sum())} tokens), length {len(ids)}, depth {args.depth}, slots {args.slots}: "
          f"{answer!r} -> {'found' if '7319264' in answer else 'missed'}")


if __name__ == "__main__":
    main()
