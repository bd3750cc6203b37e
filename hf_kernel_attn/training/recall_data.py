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

``style="varied"`` draws each fact's wording from several forms (a record, a note, a code, a map entry, a
sentence about a place), its key from names, things, places and project names, and its value from several
formats (plain numbers of 4-7 digits, grouped digits, letter-digit codes, words with a number), so that a model
trained on them learns to keep *a fact stated once* rather than one sentence pattern; none of the forms is the
wording of passkey, niah or RULER.
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
STYLES = ("plain", "varied")

# varied: (fact, question, answer) forms over {key} ({Key} at the start of a sentence) and {value}
FORMS = (
    ("\n{Key} number is {value}.\n", "\nQuestion: what is {key} number?\nAnswer:", " {Key} number is {value}."),
    ("\nFor the record, {key} is filed under {value}.\n", "\nUnder what is {key} filed?\n",
     " {Key} is filed under {value}."),
    ("\n(Note: the code for {key} was set to {value}.)\n", "\nWhich code was set for {key}?\n",
     " The code for {key} was {value}."),
    ("\n{Key} -> {value}\n", "\nLookup: {Key} ->", " {value}"),
    ("\nWe were told that {key} would be {value}, and nothing else.\n",
     "\nWhat were we told {key} would be?\nWe were told that {key} would be", " {value}."),
    ("\nThe entry for {key} reads: {value}.\n", "\nRead back the entry for {key}.\nThe entry for {key} reads:",
     " {value}."),
)
PLACES = ("the harbour office", "the north gate", "the old library", "the river depot", "the east tower",
          "the seed bank", "the night train", "the observatory", "the market hall", "the mountain hut")
PROJECTS = ("Project Heron", "Project Basalt", "Project Juniper", "Operation Lantern", "Project Quarry",
            "Operation Kestrel", "Project Tidewater", "Project Marrow")
WORDS = ("amber", "cobalt", "falcon", "granite", "harvest", "indigo", "lotus", "meadow", "orbit", "pepper",
         "quartz", "saffron", "timber", "walnut")


def _varied_key(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"{rng.choice(NAMES)}'s {rng.choice(THINGS)}"
    if kind == 1:
        return rng.choice(PLACES)
    return rng.choice(PROJECTS)


def _varied_value(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.randint(1000, 9_999_999))
    if kind == 1:
        return f"{rng.randint(10, 999)}-{rng.randint(1000, 9999)}"
    if kind == 2:
        letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
        return f"{rng.choice(letters)}{rng.choice(letters)}{rng.randint(100, 9999)}"
    return f"{rng.choice(WORDS)}-{rng.randint(2, 999)}"


def _facts(rng: random.Random, count: int, style: str) -> list[tuple[str, str, str]]:
    """``count`` facts with distinct keys: (statement, question, answer) texts."""
    if style == "plain":
        pairs = rng.sample([(n, t) for n in NAMES for t in THINGS], count)
        facts = [{"name": n, "thing": t, "value": str(rng.randint(100, 99999))} for n, t in pairs]
        return [(FACT.format(**f), QUESTION.format(**f), ANSWER.format(**f)) for f in facts]
    if style != "varied":
        raise ValueError(f"recall style must be one of {list(STYLES)}, got {style!r}")
    keys: list[str] = []
    while len(keys) < count:
        key = _varied_key(rng)
        if key not in keys:
            keys.append(key)
    out = []
    for key in keys:
        forms = rng.choice(FORMS)
        fill = {"key": key, "Key": key[0].upper() + key[1:], "value": _varied_value(rng)}
        out.append(tuple(form.format(**fill) for form in forms))
    return out


def recall_block(block: list[int], encode: Callable[[str], list[int]], rng: random.Random,
                 max_facts: int, style: str = "plain") -> list[int]:
    """``block`` (token ids) with 1 … ``max_facts`` facts inserted and asked for at the end; same length.
    Returns the block unchanged when the facts would not fit in half of it."""
    return recall_block_spans(block, encode, rng, max_facts, style)[0]


def recall_block_spans(block: list[int], encode: Callable[[str], list[int]], rng: random.Random,
                       max_facts: int, style: str = "plain") -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """:func:`recall_block` and, per fact, ``(fact_start, fact_end, answer_start, answer_end)``: where the fact
    is stated and where its answer is given (token positions, ends exclusive); no spans if the block is
    unchanged."""
    length = len(block)
    count = rng.randint(1, max_facts)
    facts = _facts(rng, count, style)
    stated = [encode(f[0]) for f in facts]
    asked = list(range(count))
    rng.shuffle(asked)
    questions = [encode(facts[i][1]) for i in asked]
    answers = [encode(facts[i][2]) for i in asked]
    tail_len = sum(len(q) + len(a) for q, a in zip(questions, answers, strict=True))
    room = length - tail_len - sum(len(s) for s in stated)
    if room < length // 2:
        return list(block), []
    filler = block[:room]
    cuts = sorted(rng.randint(0, room) for _ in stated)  # where each fact goes in the filler
    out: list[int] = []
    fact_at: list[tuple[int, int]] = []
    prev = 0
    for cut, fact in zip(cuts, stated, strict=True):
        out += filler[prev:cut]
        fact_at.append((len(out), len(out) + len(fact)))
        out += fact
        prev = cut
    out += filler[prev:]
    spans = [(0, 0, 0, 0)] * count
    for i, question, answer in zip(asked, questions, answers, strict=True):
        out += question
        spans[i] = (*fact_at[i], len(out), len(out) + len(answer))
        out += answer
    return out, spans


def recall_rows(ids: torch.Tensor, encode: Callable[[str], list[int]], rngs: list[random.Random], max_facts: int,
                style: str = "plain") -> tuple[torch.Tensor, list[list[tuple[int, int, int, int]]]]:
    """Each row of ``ids`` ``[B, L]`` with facts stated in it (:func:`recall_block_spans`, row r drawing from
    ``rngs[r]``), and each row's spans."""
    blocks = [recall_block_spans(row, encode, rng, max_facts, style)
              for row, rng in zip(ids.tolist(), rngs, strict=True)]
    return (torch.tensor([blk for blk, _ in blocks], dtype=ids.dtype, device=ids.device),
            [spans for _, spans in blocks])


def with_recall_facts(blocks: torch.Tensor, encode: Callable[[str], list[int]], *, fraction: float,
                      max_facts: int, seed: int, style: str = "plain") -> torch.Tensor:
    """A copy of the training ``blocks`` ``[n, L]`` in which round(fraction · n) blocks, drawn from ``seed``,
    carry recall facts (:func:`recall_block`)."""
    n = len(blocks)
    chosen = random.Random(seed).sample(range(n), round(fraction * n)) if n else []
    out = blocks.clone()
    for i in chosen:
        rng = random.Random(seed * 1_000_003 + i)
        out[i] = torch.tensor(recall_block(blocks[i].tolist(), encode, rng, max_facts, style), dtype=blocks.dtype)
    return out


def recall_targets(tokens: list[int], spans: list[tuple[int, int, int, int]],
                   is_value: Callable[[int], bool]) -> list[tuple[int, int]]:
    """Copy targets of a recall block: for the j-th value token (``is_value``, e.g. a digit) of each answer, the
    pair (query position = the token before it, key position = the j-th value token of its stated fact). A head
    that retrieves puts its attention there when the answer is produced (Wu et al. 2024, "Retrieval Head
    Mechanistically Explains Long-Context Factuality")."""
    pairs: list[tuple[int, int]] = []
    for fact_start, fact_end, answer_start, answer_end in spans:
        stated = [p for p in range(fact_start, fact_end) if is_value(tokens[p])]
        answered = [p for p in range(answer_start, answer_end) if is_value(tokens[p])]
        pairs += [(a - 1, s) for a, s in zip(answered, stated, strict=False)]
    return pairs


def recall_span_targets(spans: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """Retrieval targets of a recall block: every position that predicts an answer token (from the token before
    the answer to the one before its last), paired with the span where that fact was stated, ``(t, s, e)``. The
    attention mass a head puts there while the answer is produced marks the heads a model retrieves with,
    including the earlier-layer heads that find the fact before the copying heads read it."""
    return [(t, fact_start, fact_end) for fact_start, fact_end, answer_start, answer_end in spans
            for t in range(answer_start - 1, answer_end - 1)]
