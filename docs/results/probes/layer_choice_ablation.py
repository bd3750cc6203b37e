"""Which layers to keep as softmax, at equal training: a `layers: auto:K` run's transfer-end checkpoint (every
layer's kernel trained) evaluated with its automatic choice, with fixed choices, and with no softmax layer.

    python docs/results/probes/layer_choice_ablation.py --run outputs/smollm2-hedgehog-window64-auto2 \
        --checkpoint outputs/auto2-transfer-checkpoint --fixed 0,29 \
        --data-file ../shared/data/wikitext-2-raw/wiki.valid.raw --output docs/results/layer-choice-ablation.json

WikiText-2 perplexity on the first 2,048 tokens in 256-token blocks (docs/results.md's protocol).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kernel_attn
from hf_kernel_attn.evaluation.perplexity import perplexity, read_text
from hf_kernel_attn.integration.layer_choice import apply_choice
from hf_kernel_attn.training.checkpoint import load_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="output_dir of a layers: auto:K run")
    p.add_argument("--checkpoint", required=True, help="its transfer-end checkpoint folder (model.pt)")
    p.add_argument("--fixed", action="append", default=[], help="comma-separated layers to keep as softmax")
    p.add_argument("--data-file", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    cfg = yaml.safe_load((run / "config.resolved.yaml").read_text())
    auto = json.loads((run / "auto_layers.json").read_text())
    text = read_text(args.data_file)
    tok = AutoTokenizer.from_pretrained(run / "base-model")
    state = load_file(Path(args.checkpoint), "model.pt")
    choices = {f"auto:{auto['keep_softmax']} {auto['softmax_layers']}": auto["softmax_layers"]}
    for fixed in args.fixed:
        layers = [int(x) for x in fixed.split(",")]
        choices[f"fixed {layers}"] = layers
    choices["none (every layer converted)"] = []
    results = []
    for name, layers in choices.items():
        model = AutoModelForCausalLM.from_pretrained(run / "base-model").eval()
        hf_kernel_attn.patch(model, kernel=cfg["kernel"], **cfg["kernel_params"])
        model.load_state_dict(state)
        apply_choice(model, cfg["kernel"], cfg["kernel_params"], layers, {"softmax_layers": layers})
        score = perplexity(model, tok, text, block_size=256, max_tokens=2048)
        errors = [auto["errors"][str(i)] for i in layers]
        results.append({"choice": name, "softmax_layers": layers, "transfer_errors": errors, **score})
        print(f"{name:40s} perplexity {score['perplexity']:.2f}", flush=True)
    Path(args.output).write_text(json.dumps({"run": str(run), "checkpoint": args.checkpoint, "results": results,
                                             "errors": auto["errors"]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
