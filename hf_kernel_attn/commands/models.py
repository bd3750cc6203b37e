"""Commands on one causal LM: ``convert-gguf``, ``perplexity``, ``decode-bench``, ``diagnose``."""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..evaluation.diagnose import diagnose, format_report
from ..evaluation.perplexity import perplexity, read_text
from ..integration.loading import convert_gguf
from ..integration.patching import kernel_config
from ..integration.swap import patch
from ..kernel_args import SAVED, format_kernel_spec, resolve_kernels
from ..kernels import KERNELS, SOFTMAX
from ..model_paths import load_errors, locate_model
from ..speed.decoding import run_decode_suite
from ..speed.kernel_bench import format_machine, machine_info


def load_causal_lm(model: str, gguf_file: str | None, path: str | None = None):
    """A causal LM and its tokenizer from a folder, pkg:PACKAGE or hub id (``path``: ``model`` as
    :func:`~hf_kernel_attn.model_paths.locate_model` resolved it already); one-line errors."""
    path = path if path is not None else locate_model(model, gguf_file)
    load = {"gguf_file": gguf_file} if gguf_file else {}
    with load_errors(model, gguf_file):
        return AutoModelForCausalLM.from_pretrained(path, **load).eval(), AutoTokenizer.from_pretrained(path, **load)


def check_kernels(names: list[str]) -> None:
    """SystemExit naming the unknown kernels and the available ones."""
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise SystemExit(f"unknown kernel(s) {unknown}; available kernels: {sorted(KERNELS)}")


def convert_command(args: argparse.Namespace) -> int:
    path = locate_model(args.model, args.gguf_file)
    with load_errors(args.model, args.gguf_file):
        out = convert_gguf(path, args.gguf_file, args.output)
    print(f"saved a normal checkpoint to {out}")
    return 0


def perplexity_command(args: argparse.Namespace) -> int:
    path = locate_model(args.model, args.gguf_file)
    kernels = resolve_kernels(args.kernels, args.param, softmax=SOFTMAX)
    check_kernels([name for name, _ in kernels if name != SAVED])
    text = read_text(args.data_file)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tok = load_causal_lm(args.model, args.gguf_file, path)
    results = []
    for spec, (name, options) in zip(args.kernels, kernels, strict=True):
        if name == SAVED:
            saved = kernel_config(model)
            label = f"{SAVED}:{saved.kernel if saved else SOFTMAX}"
        else:
            patch(model, kernel=name, **options)
            label = spec
        start = time.perf_counter()
        res = perplexity(model, tok, text, block_size=args.block_size, max_tokens=args.max_tokens)
        res.update(kernel=label, seconds=round(time.perf_counter() - start, 2))
        results.append(res)
        print(f"{label:10s} perplexity {res['perplexity']:12.3f}  ({res['tokens']} tokens, {res['seconds']} s)",
              flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def decode_bench_command(args: argparse.Namespace) -> int:
    path = locate_model(args.model, args.gguf_file)
    named = [k for k in args.kernels if k != SAVED]  # `saved`: the kernels the model folder was saved with
    kernels = resolve_kernels(named, args.param, softmax=SOFTMAX)
    check_kernels([name for name, _ in kernels])
    specs = iter(format_kernel_spec(name, options) for name, options in kernels)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_causal_lm(args.model, args.gguf_file, path)
    print(format_machine(machine_info(torch.get_num_threads())))
    rows = run_decode_suite(
        model, [SAVED if k == SAVED else next(specs) for k in args.kernels], args.contexts, steps=args.steps,
        synthetic=args.synthetic_cache,
        progress=lambda r: print(f"{r['kernel']:10s} context {r['context']:6d}: {r['decode_ms']:8.2f} ms/token, "
                                 f"cache {r['cache_bytes'] / 2**20:8.1f} MiB "
                                 + ("(synthetic cache)" if r["synthetic"] else f"(prefill {r['prefill_s']:.1f} s)"),
                                 flush=True),
    )
    print("\n| kernel | context | ms/token (median) | × softmax (K/V cache) | ms/token (mean) | × softmax (mean) | "
          "× own shortest context | cache MiB | prefill tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = "–" if r["prefill_tokens_per_s"] is None else f"{r['prefill_tokens_per_s']:.0f}"
        print(f"| {r['kernel']} | {r['context']} | {r['decode_ms']:.2f} | {r['ratio_vs_softmax']:.2f} | "
              f"{r['decode_ms_mean']:.2f} | {r['ratio_mean_vs_softmax']:.2f} | "
              f"{r['ratio_vs_shortest']:.2f} | {r['cache_bytes'] / 2**20:.1f} | {rate} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"machine": machine_info(torch.get_num_threads()), "rows": rows}, f, indent=1)
    return 0


def diagnose_command(args: argparse.Namespace) -> int:
    path = locate_model(args.model, args.gguf_file)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = read_text(args.data_file)
    model, tok = load_causal_lm(args.model, args.gguf_file, path)
    res = diagnose(model, tok, text, tokens=args.tokens, blocks=args.blocks)
    res["model"] = args.model
    print(format_report(res))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    return 0
