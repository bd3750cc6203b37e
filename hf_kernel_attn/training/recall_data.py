"""Recall-aware training text: synthetic key-value facts stated once inside natural training text and
asked for at the end of the same block.

A block of ``seq_len`` training tokens becomes

    filler … "\\n{Name}'s {thing} number is {value}.\\n" … filler … (up to ``max_facts`` facts) …
    "\\nQuestion: what is {Name}'s {thing} number?\\nAnswer: {Name}'s {thing} number is {value}." (each fact, in
    a shuffled order)

still exactly ``seq_len`` tokens: the filler is the block's own text, cut at the end to make room. Next-token
training on the answers (or the teacher's distribution there, in distillation) rewards attention that finds a
fact stated hundreds of tokens back, which language-modelling text alone rarely asks for (Arora et al. 2024,
"Zoology", on associative recall as the gap between linear attention and softmax). The wording differs from
the evaluation tasks' (passkey, niah, kv_recall), and the filler is the training files' own text, so the
held-out rule is unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena",
         "Mira", "Nils", "Omar", "Pia", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Viktor", "Wen", "Yara")
THINGS = ("locker", "room", "ticket", "account", "badge", "table", "seat", "parcel", "car", "order")
FACT = "\n{name}'s {thing} number is {value}.\n"
QUESTION = "\nQuestion: what is {name}'s {thing} number?\nAnswer:"
ANSWER = " {name}'s {thing} number is {value}."


def recall_block(block: list[int], encode: Callable[[str], list[int]], rng: random.Random,
                 max_facts: int) -> list[int]:
    """``block`` (token ids) with 1 … ``max_facts`` facts inserted and asked for at the end; same length.
    Returns the block unchanged when the facts would not fit in half of it."""
    length = len(block)
    count = rng.randint(1, max_facts)
    pairs = rng.sample([(n, t) for n in NAMES for t in THINGS], count)
    facts = [{"name": n, "thing": t, "value": str(rng.randint(100, 99999))} for n, t in pairs]
    stated = [encode(FACT.format(**f)) for f in facts]
    asked = list(range(count))
    rng.shuffle(asked)
    tail = [tok for i in asked for tok in encode(QUESTION.format(**facts[i])) + encode(ANSWER.format(**facts[i]))]
    room = length - len(tail) - sum(len(s) for s in stated)
    if room < length // 2:
        return list(block)
    filler = block[:room]
    cuts = sorted(rng.randint(0, room) for _ in stated)  # where each fact goes in the filler
    out: list[int] = []
    prev = 0
    for cut, fact in zip(cuts, stated, strict=True):
        out += filler[prev:cut] + fact
        prev = cut
    out += filler[prev:] + tail
    return out


def with_recall_facts(blocks: torch.Tensor, encode: Callable[[str], list[int]], *, fraction: float,
                      max_facts: int, seed: int) -> torch.Tensor:
    """A copy of the training ``blocks`` ``[n, L]`` in which round(fraction · n) blocks, drawn from ``seed``,
    carry recall facts (:func:`recall_block`)."""
    n = len(blocks)
    chosen = random.Random(seed).sample(range(n), round(fraction * n)) if n else []
    out = blocks.clone()
    for i in chosen:
        rng = random.Random(seed * 1_000_003 + i)
        out[i] = torch.tensor(recall_block(blocks[i].tolist(), encode, rng, max_facts), dtype=blocks.dtype)
    return out
