"""``kv_recall``: in-context associative recall for a pretrained LM (the pretrained-model form of MQAR,
Arora et al. 2024, "Zoology"): a list of ``key: value`` lines (unique 4-digit keys, word values) filling
the context, then several keys asked for in turn. Queries are scored teacher-forced in one forward pass:
a query counts as correct iff every token of " value" and the newline after it is the model's argmax
given the gold tokens before it, which is exactly "the greedy continuation starts with the value". The
first query asks the pair at the cell's depth (metric ``exact_match``); ``exact_match_all`` averages every
query of the prompt (the later ones at random depths, asked with the earlier answers in context)."""

from __future__ import annotations

from .base import LongContextTask, Sample, haystack_budget, register_task, rng_for
from .words import WORDS

INSTRUCTION = ("Here is a list of keys and their values. Remember them: you will be asked for the values of "
               "some keys afterwards.")
PAIR = "\n{key}: {value}"
ASK = "\n\nThe values of some keys:"
QUERIES = 4


@register_task
class KvRecall(LongContextTask):
    name = "kv_recall"
    kind = "teacher"
    metrics = ("exact_match", "exact_match_all")

    def samples(self, encode, length, depth, count, seed, *, metric="exact_match", text_ids=None, bos=()):
        prefix, ask, newline = [*bos, *encode(INSTRUCTION)], encode(ASK), encode("\n")
        out = []
        for i in range(count):
            rng = rng_for(seed, self.name, length, depth, i)
            keys = [str(k) for k in rng.sample(range(1000, 10000), 9000)]
            pairs: list[list[int]] = []
            values: list[str] = []
            # the queries are built for the longest possible list, then the list is filled to the budget
            query_len = max(len(encode(f"\n{k}:")) for k in keys[:50]) + max(len(encode(f" {w}")) for w in WORDS) + 1
            budget = haystack_budget(length, prefix, ask, [0] * (QUERIES * query_len))
            used = 0
            for key in keys:
                value = rng.choice(WORDS)
                pair = encode(PAIR.format(key=key, value=value))
                if used + len(pair) > budget:
                    break
                pairs.append(pair)
                values.append(value)
                used += len(pair)
            if len(pairs) < QUERIES:
                raise ValueError(f"kv_recall: a {length}-token prompt holds only {len(pairs)} pairs; "
                                 "use longer --lengths")
            first = round(depth / 100 * (len(pairs) - 1))
            others = rng.sample([j for j in range(len(pairs)) if j != first], QUERIES - 1)
            asked = [first, *others]
            ids = list(prefix)
            needle_start = 0
            for j, pair in enumerate(pairs):
                if j == first:
                    needle_start = len(ids)
                ids += pair
            question_start = len(ids)  # the list ends, the questions begin
            ids += ask
            spans = []
            for j in asked:
                ids += encode(f"\n{keys[j]}:")
                start = len(ids)
                ids += encode(f" {values[j]}") + newline
                spans.append((start, len(ids)))
            fill = length - len(ids)
            if fill < 0:
                raise ValueError(f"kv_recall: the prompt came out {-fill} tokens over {length}")
            # pad the gap (shorter than one query) with newlines before the list, shifting every position
            ids = ids[:len(prefix)] + newline * fill + ids[len(prefix):] if newline else ids
            spans = [(s + fill, e + fill) for s, e in spans]
            out.append(Sample(ids, [values[j] for j in asked], needle_start + fill, length, depth,
                              {"answer_spans": spans, "pairs": len(pairs), "asked": asked},
                              question_start=question_start + fill))
        return out
