"""Perplexity of a causal LM on a text: exp(mean next-token NLL) over non-overlapping blocks."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    return text[:max_chars] if max_chars else text


@torch.no_grad()
def perplexity(model, tokenizer, text: str, *, block_size: int = 512, max_tokens: int | None = None,
               batch_size: int = 1) -> dict[str, float]:
    """Split the tokenised text into blocks of ``block_size`` tokens (the last partial block is dropped)
    and average the next-token negative log-likelihood over every predicted token."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if max_tokens:
        ids = ids[:max_tokens]
    n_blocks = ids.numel() // block_size
    if n_blocks == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one block of {block_size}")
    blocks = ids[: n_blocks * block_size].view(n_blocks, block_size)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, n_blocks, batch_size):
        batch = blocks[start : start + batch_size].to(device)
        logits = model(batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += batch[:, 1:].numel()
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}
