"""Save a converted model again with another finetune config's inference options, without training it again.

Several SmolLM2 presets are trained identically and differ only in options that need no training
(``inference_params``, ``inference_layers``): the sinks + window recall recipe, its bounded sparse cache
(``*-constmem.yaml``) and its retrieval layers on a budget (``*-retrieval16-constmem.yaml``). With the first one's
``final`` folder, this writes the others' as ``finetune`` would have saved them (the config's ``output_dir``/final,
or ``--output``): the same weights and files, ``config.json``'s ``kernel_attention`` with the config's inference
options added (what ``finetune`` does at its final save). The written folder is checked by loading it.

    python scripts/save_inference_variant.py outputs/smollm2-hedgehog-sinks-window64-recall/final \\
        configs/smollm2/hedgehog-sinks-window64-constmem.yaml
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import types
from pathlib import Path

import hf_kernel_attn
from hf_kernel_attn.integration.loading import with_saved_kernel_options
from hf_kernel_attn.training import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trained", help="the final folder of a run trained exactly as CONFIG trains")
    parser.add_argument("config", help="the finetune config whose inference options to save")
    parser.add_argument("--output", default=None, help="where to write (default: the config's output_dir/final)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    trained = Path(args.trained)
    saved = json.loads((trained / "config.json").read_text())
    if not saved.get("kernel_attention"):
        print(f"error: {trained} is not a converted model (its config.json has no kernel_attention)", file=sys.stderr)
        return 2
    if saved["kernel_attention"].get("kernel") != config["kernel"]:
        print(f"error: {trained} runs {saved['kernel_attention'].get('kernel')!r}, {args.config} trains "
              f"{config['kernel']!r}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path(config["output_dir"]) / "final"
    if out.exists():
        print(f"error: {out} exists; remove it or give --output", file=sys.stderr)
        return 2
    shell = types.SimpleNamespace(kernel_attention=saved["kernel_attention"],
                                  num_hidden_layers=saved.get("num_hidden_layers"))
    options = with_saved_kernel_options(shell, config["inference_params"], config["inference_layers"])
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(trained, tmp)
    saved["kernel_attention"] = options.kernel_attention
    (tmp / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    hf_kernel_attn.from_pretrained(tmp)  # the options are valid for this model
    tmp.rename(out)
    print(f"wrote {out} ({args.config}'s inference options on {trained})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
