"""Shared pieces of the long-context tasks: the task contract, token-level prompt assembly with a needle at
a given depth, deterministic random streams, and exact-match scoring.

Prompts are built from token ids, not by re-tokenising a joined string, so a prompt has exactly the
requested number of tokens and the needle starts at a known token index. Every piece of text starts with a
space or a newline, so that tokenising the pieces one by one gives the tokens a whole-string tokenisation
would give (checked in tests/evaluation/test_long_context.py).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ...registry import Registry, describe

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_SAMPLES = 20

Encode = Callable[[str], list[int]]


@dataclasses.dataclass
class Sample:
    """One prompt: ``ids`` (exactly ``length`` tokens), the expected ``answers`` (one per query; a query is
    asked greedily at the end or, for teacher-forced queries, at ``query_starts``), where the needle (the
    asked fact) starts (``needle_start``: token index in ``ids``) and where the question starts
    (``question_start``: ``ids[:question_start]`` is the context a KV-cache press compresses, the rest is asked
    after it; None for tasks without a question)."""

    ids: list[int]
    answers: list[str]
    needle_start: int
    length: int
    depth: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    question_start: int | None = None


def rng_for(seed: int, *parts: Any) -> random.Random:
    """A random stream fixed by ``seed`` and ``parts`` (str seeding hashes with SHA-512: the same in every
    process, unlike ``hash()``)."""
    return random.Random("/".join(str(p) for p in (seed, *parts)))


def random_digits(rng: random.Random, n: int) -> str:
    """An ``n``-digit number without a leading zero."""
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


def first_number(text: str) -> str | None:
    """The first run of digits in ``text`` (the answer a greedy continuation gives), or None."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


def exact_match(prediction: str | None, answer: str) -> bool:
    """True iff the predicted answer string equals the expected one exactly."""
    return prediction is not None and prediction == answer


def needle_index(depth: float, haystack_tokens: int, boundaries: Sequence[int]) -> int:
    """The insertion point (a token index into the haystack, one of ``boundaries``) nearest to ``depth``
    percent of ``haystack_tokens``: 0 = before the first haystack token, 100 = after the last."""
    if not 0 <= depth <= 100:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth!r}")
    target = depth / 100 * haystack_tokens
    return min(boundaries, key=lambda b: (abs(b - target), b))


def assemble(prefix: list[int], haystack: list[int], inserts: dict[int, list[int]], suffix: list[int]) -> list[int]:
    """prefix + haystack with each ``inserts[i]`` placed before haystack token i (i may equal its length) +
    suffix."""
    out = list(prefix)
    last = 0
    for at in sorted(inserts):
        out += haystack[last:at] + inserts[at]
        last = at
    return out + haystack[last:] + suffix


def haystack_budget(length: int, *fixed: list[int]) -> int:
    """Tokens left for the haystack in a prompt of ``length`` tokens; ValueError if the fixed parts do not fit."""
    used = sum(len(f) for f in fixed)
    if used >= length:
        raise ValueError(f"a {length}-token prompt cannot hold its fixed parts ({used} tokens); use longer --lengths")
    return length - used


class LongContextTask:
    """A long-context task: ``samples(encode, length, depth, count, seed, ...)`` builds prompts; the runner
    scores them. ``kind`` is ``generate`` (greedy continuation, first number exact match), ``teacher``
    (several queries scored in one forward pass) or ``loss`` (next-token loss by position)."""

    name: ClassVar[str]
    kind: ClassVar[str]
    metrics: ClassVar[tuple[str, ...]] = ("exact_match",)
    needs_text: ClassVar[bool] = False  # reads natural text from --data-dir
    answer_digits: ClassVar[int] = 0  # generated tokens are bounded by the answer's length
    # how `--plot-dir` draws its records: "grid" (accuracy by length x depth) or "curve" (a value by position)
    plot: ClassVar[str] = "grid"

    def samples(self, encode: Encode, length: int, depth: float, count: int, seed: int, *,
                metric: str = "exact_match", text_ids: list[int] | None = None) -> list[Sample]:
        raise NotImplementedError


TASKS: Registry[LongContextTask] = Registry("long-context task", LongContextTask, instances=True)


def register_task(cls: type[LongContextTask]) -> type[LongContextTask]:
    """Class decorator: add an instance of ``cls`` to the registry under ``cls.name``. The same class again is
    fine; another class under a taken name is a ValueError (:class:`hf_kernel_attn.registry.Registry`)."""
    if not (isinstance(cls, type) and issubclass(cls, LongContextTask)):
        raise TypeError(f"register_task takes a subclass of LongContextTask, got {cls!r}")
    if cls.name in TASKS and describe(type(TASKS.get(cls.name))) == describe(cls):
        TASKS.pop(cls.name)  # the same class again (or its module run again): its new instance replaces the old
    TASKS.register(cls.name, cls())
    return cls
