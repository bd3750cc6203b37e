"""``passkey``: a random 5-digit key stated once inside repeated filler, asked for at the end; exact match of
the first number in the greedy continuation (Mohtashami & Jaggi 2023, "Landmark Attention", whose filler and
question this follows, with two changes that SmolLM2-135M-Instruct needed to score ≥ 90 % at every depth:
the question starts a new line, and the needle's second statement is "The pass key is {key}." instead of
"{key} is the pass key.")."""

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

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.")
FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
          " There and back again.")
# Landmark's needle ends " {key} is the pass key."; SmolLM2-135M then often answers " the pass key" (copying
# that sentence's end: 15-17 of 20 at 1,024 tokens, depth 25); stated once, the key is missed at 2,048 tokens,
# depth 50 (0 of 20); stated twice in the question's own words, both pass (10 of 10, 4 of 4)
NEEDLE = " The pass key is {key}. Remember it. The pass key is {key}."
# the question starts a new line: asked on the needle's line right after it (depth 100), SmolLM2-135M
# continued "... 24200 is the pass key. What is the pass key? The pass key is" with " the pass key" (0 of 6)
QUESTION = "\nWhat is the pass key? The pass key is"


def repeated_haystack(encode, sentences: tuple[str, ...], tokens: int) -> tuple[list[int], list[int]]:
    """The first ``tokens`` tokens of the sentences repeated, and the sentence starts (insertion points,
    including the end)."""
    units = [encode(s) for s in sentences]
    ids: list[int] = []
    starts = []
    i = 0
    while len(ids) < tokens:
        starts.append(len(ids))
        ids += units[i % len(units)]
        i += 1
    ids = ids[:tokens]
    return ids, [s for s in starts if s < tokens] + [tokens]


@register_task
class Passkey(LongContextTask):
    name = "passkey"
    kind = "generate"
    answer_digits = 5

    def samples(self, encode, length, depth, count, seed, *, metric="exact_match", text_ids=None, bos=()):
        prefix, question = [*bos, *encode(INSTRUCTION)], encode(QUESTION)
        out = []
        for i in range(count):
            key = random_digits(rng_for(seed, self.name, length, depth, i), self.answer_digits)
            needle = encode(NEEDLE.format(key=key))
            budget = haystack_budget(length, prefix, needle, question)
            hay, starts = repeated_haystack(encode, FILLER, budget)
            at = needle_index(depth, budget, starts)
            ids = assemble(prefix, hay, {at: needle}, question)
            out.append(Sample(ids, [key], len(prefix) + at, length, depth,
                              {"haystack_start": len(prefix), "haystack_tokens": budget},
                              question_start=len(ids) - len(question)))
        return out
