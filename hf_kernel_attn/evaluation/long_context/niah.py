"""``niah``: needle-in-a-haystack in natural text (RULER, Hsieh et al. 2024): "One of the special magic numbers
for {key} is: {value}." inside WikiText/PTB text read from ``--data-dir``, asked for at the end; exact match
of the first number in the greedy continuation. Metrics: ``exact_match`` (one needle) and
``exact_match_multikey`` (the asked needle plus three distractor needles with other keys at random depths)."""

from __future__ import annotations

from .base import (
    LongContextTask,
    Sample,
    assemble,
    haystack_budget,
    needle_index,
    random_digits,
    register_task,
    rng_for,
)
from .filler import TokenizedText
from .words import WORDS

INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
NEEDLE = " One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? The special magic "
            "number for {key} mentioned in the provided text is")
DISTRACTORS = 3
VALUE_DIGITS = 7


def sentence_starts(text_ids: list[int], start: int, tokens: int, is_boundary) -> list[int]:
    """Insertion points in ``text_ids[start:start + tokens]``: indices i (relative) where a new sentence starts
    (``is_boundary(i_abs)``), plus 0 and the end."""
    points = {0, tokens}
    points.update(i - start for i in range(start + 1, start + tokens) if is_boundary(i))
    return sorted(points)


@register_task
class Niah(LongContextTask):
    name = "niah"
    kind = "generate"
    metrics = ("exact_match", "exact_match_multikey")
    needs_text = True
    answer_digits = VALUE_DIGITS

    def samples(self, encode, length, depth, count, seed, *, metric="exact_match",
                text_ids: TokenizedText | None = None, bos=()):
        """``text_ids``: the filler text with its sentence starts (a :class:`.filler.TokenizedText`); each needle
        goes in between two sentences."""
        if not isinstance(text_ids, TokenizedText):
            raise ValueError("niah needs natural filler text (text_ids: a TokenizedText, which knows its sentence "
                             "starts); pass --data-dir")
        distractors = DISTRACTORS if metric == "exact_match_multikey" else 0
        prefix = [*bos, *encode(INSTRUCTION)]
        out = []
        for i in range(count):
            rng = rng_for(seed, self.name, metric, length, depth, i)
            keys = rng.sample(WORDS, 1 + distractors)
            values = [random_digits(rng, VALUE_DIGITS) for _ in keys]
            needles = [encode(NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values, strict=True)]
            question = encode(QUESTION.format(key=keys[0]))
            budget = haystack_budget(length, prefix, *needles, question)
            if budget > len(text_ids):
                raise ValueError(f"niah: the filler text has {len(text_ids)} tokens, fewer than the {budget} a "
                                 f"{length}-token prompt needs")
            begin = rng.randrange(0, len(text_ids) - budget + 1)
            hay = text_ids[begin:begin + budget]
            starts = sentence_starts(text_ids, begin, budget, text_ids.is_boundary)
            at = needle_index(depth, budget, starts)
            inserts = {at: needles[0]}
            free = [s for s in starts if s != at]
            for needle in needles[1:]:
                spot = free.pop(rng.randrange(len(free))) if free else at
                inserts[spot] = inserts.get(spot, []) + needle
            ids = assemble(prefix, hay, inserts, question)
            shift = sum(len(v) for k, v in inserts.items() if k < at)
            out.append(Sample(ids, [values[0]], len(prefix) + at + shift, length, depth,
                              {"haystack_start": len(prefix), "haystack_tokens": budget, "key": keys[0],
                               "distractors": distractors}, question_start=len(ids) - len(question)))
        return out
