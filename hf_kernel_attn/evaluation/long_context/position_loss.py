"""``position_loss``: next-token loss on long natural text (WikiText/PTB from ``--data-dir``) bucketed by
token position — 0–L1, L1–L2, … for the sorted ``--lengths`` L1 < L2 < … — on ``--samples`` sequences of
max(--lengths) tokens. Loss that keeps falling with position means the model uses the longer context; a
curve that flattens at W tokens means it sees only its window."""

from __future__ import annotations

from .base import LongContextTask, Sample, register_task, rng_for


def buckets(lengths: list[int]) -> list[tuple[int, int]]:
    """[(0, L1), (L1, L2), …] over the sorted distinct lengths."""
    edges = sorted(set(lengths))
    return list(zip([0, *edges[:-1]], edges, strict=True))


@register_task
class PositionLoss(LongContextTask):
    name = "position_loss"
    plot = "curve"  # loss by position bucket
    kind = "loss"
    metrics = ("loss",)
    needs_text = True

    def samples(self, encode, length, depth, count, seed, *, metric="loss", text_ids=None, bos=()):
        """``count`` windows of ``length`` tokens at distinct offsets of the text (non-overlapping when the
        text is long enough); ``depth`` is unused."""
        if text_ids is None:
            raise ValueError("position_loss needs natural text; pass --data-dir")
        body = length - len(bos)
        if body > len(text_ids):
            raise ValueError(f"position_loss: the text has {len(text_ids)} tokens, fewer than --lengths max {length}")
        slots = max(1, len(text_ids) // body)
        rng = rng_for(seed, self.name, length)
        chosen = rng.sample(range(slots), min(count, slots))
        chosen += [rng.randrange(slots) for _ in range(count - len(chosen))]
        return [Sample([*bos, *text_ids[s * body:(s + 1) * body]], [], 0, length, depth) for s in chosen]
