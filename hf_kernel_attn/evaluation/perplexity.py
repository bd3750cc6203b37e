"""Perplexity of a causal LM on a text: exp(mean next-token NLL) over non-overlapping blocks."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..data.files import read_text_file


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    """A UTF-8 text file; ValueError naming the file when it is missing, binary, not UTF-8 or empty."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    text = read_text_file(path, allow_empty=False)
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
        raise ValueError(f"the text ({_snippet(text)}) has {ids.numel()} tokens, fewer than one block of "
                         f"{block_size}; use a longer text or a smaller block size")
    blocks = ids[: n_blocks * block_size].view(n_blocks, block_size)
    total, count = block_nll(model, blocks, batch_size)
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}


@torch.no_grad()
def block_nll(model, blocks: torch.Tensor, batch_size: int = 1) -> tuple[float, int]:
    """(Σ next-token NLL, number of predicted tokens) over the rows of ``blocks`` (``[n, L]`` token ids, each row
    on its own): the one perplexity computation that evaluation, diagnosis and training validation share."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += batch[:, 1:].numel()
    return total, count


@torch.no_grad()
def strided_perplexity(model, tokenizer, text: str, *, context: int = 1024, stride: int | None = None,
                       limit: int | None = None, batch_size: int = 1) -> dict[str, float]:
    """Token-level perplexity of ``text`` as one token stream (the transformers perplexity guide):
    window w covers tokens [w·stride, w·stride + context); it scores the tokens no earlier window
    scored, with the rest of the window as left context. With stride = context the windows are disjoint
    and each window's first token is not scored (it has no context), as in the guide. ``limit``: the
    first ``limit`` windows.

    Also returns bits per byte, Σ NLL / (ln 2 · UTF-8 bytes of the scored text), which does not depend
    on the tokenizer."""
    stride = stride or context
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 2 and 1 <= stride <= context; got context={context}, stride={stride}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    offsets = enc["offset_mapping"]
    if ids.numel() < 2:
        raise ValueError(f"the text ({_snippet(text)}) has {ids.numel()} token(s); perplexity needs at least 2")
    windows = []  # (begin, end, first scored position)
    scored_until = 1
    for begin in range(0, ids.numel() - 1, stride):
        end = min(begin + context, ids.numel())
        if end <= scored_until:
            break
        windows.append((begin, end, scored_until))
        scored_until = end
        if end == ids.numel():
            break
    if limit:
        windows = windows[:limit]
    device = next(model.parameters()).device
    from tqdm.auto import tqdm

    total, count = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc="perplexity windows", leave=False):
        group = windows[start:start + batch_size]
        if len({e - b for b, e, _ in group}) > 1:  # the last window may be shorter: run it alone
            for w in group:
                t, c = _score_windows(model, ids, [w], device)
                total, count = total + t, count + c
        else:
            t, c = _score_windows(model, ids, group, device)
            total, count = total + t, count + c
    last = windows[-1][1] - 1
    first = offsets[windows[0][2]][0]
    n_bytes = len(text[first:offsets[last][1]].encode("utf-8"))
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count,
            "bits_per_byte": total / (math.log(2) * max(n_bytes, 1)), "bytes": n_bytes, "windows": len(windows)}


def _snippet(text: str, width: int = 40) -> str:
    """``len`` characters and the start of ``text``, for error messages."""
    return f"{len(text)} characters: {text[:width]!r}{'...' if len(text) > width else ''}"


def _score_windows(model, ids: torch.Tensor, windows: list[tuple[int, int, int]], device) -> tuple[float, int]:
    batch = torch.stack([ids[b:e] for b, e, _ in windows]).to(device)
    logits = model(batch, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(-1, batch[:, 1:, None])[..., 0]  # nll[:, t] predicts token t + 1 of the window
    total, count = 0.0, 0
    for row, (b, _e, first) in enumerate(windows):
        part = nll[row, max(first, b + 1) - b - 1:]  # a window's own first token has no context
        total += float(part.sum())
        count += part.numel()
    return total, count
