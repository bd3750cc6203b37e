"""Logits of a patched model on fixed random tokens, saved for comparing two checkouts (or dtypes) of a kernel.

    python scripts/kernel_logits.py --model DIR --kernel dijiang --param window=32 --output a.pt
    python scripts/kernel_logits.py --compare a.pt b.pt [reference.pt]

``--compare`` prints the largest absolute difference of the two (and of each to a third, e.g. a float64 run),
and the share of positions whose argmax agrees.
"""

from __future__ import annotations

import argparse

import torch
import yaml
from transformers import AutoModelForCausalLM

import hf_kernel_attn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--kernel")
    parser.add_argument("--param", action="append", default=[], help="KEY=VALUE (YAML value), repeatable")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--output")
    parser.add_argument("--compare", nargs="+", metavar="FILE")
    args = parser.parse_args()
    if args.compare:
        if len(args.compare) not in (2, 3):
            parser.error("--compare takes two files, or three (the third a reference)")
        a, b, *ref = (torch.load(f) for f in args.compare)
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
        print(f"max |a - b| {(a - b).abs().max().item():.3g}  argmax agree {agree:.4f}")
        if ref:
            for name, x in (("a", a), ("b", b)):
                print(f"max |{name} - reference| {(x.double() - ref[0].double()).abs().max().item():.3g}")
        return
    if not (args.model and args.kernel and args.output):
        parser.error("--model, --kernel and --output are needed (or --compare)")
    params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--param {item!r}: expected KEY=VALUE")
        params[key] = yaml.safe_load(value)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval().to(getattr(torch, args.dtype))
    hf_kernel_attn.patch(model, kernel=args.kernel, **params)
    ids = torch.randint(100, 5000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save(model(ids).logits[0], args.output)


if __name__ == "__main__":
    main()
