"""Scoring the long-context tasks on a causal LM: greedy generation (``generate`` tasks), teacher-forced
queries (``teacher``) and per-position loss (``loss``). One result per (metric, length, depth) cell. With a
KV-cache press (:mod:`hf_kernel_attn.evaluation.presses`, on the unconverted softmax model), each prompt's context
is compressed before its question (:func:`score_with_press`); the prompts and scores are the task's own."""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from ...integration.cache import cache_bytes, cache_kwarg, new_cache
from ..families.text import read_text_task
from ..presses import PressResult, PressRunner
from ..task import accuracy_stderr
from .base import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_SAMPLES,
    TASKS,
    LongContextTask,
    Sample,
    exact_match,
    first_number,
)
from .filler import TokenizedText
from .position_loss import buckets

BATCH_TOKENS = 8192  # prompt tokens per forward batch
TEXT_TASK = "wikitext2"  # the natural text of niah and position_loss


def check_long_context_args(lengths: Sequence[int], depths: Sequence[float], samples: int, seed: int) -> None:
    """ValueError naming the bad value."""
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 16 for n in lengths):
        raise ValueError(f"--lengths must be integers >= 16, got {list(lengths)}")
    if not depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths must be percentages in [0, 100], got {list(depths)}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"--samples must be an integer >= 1, got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"--seed must be an integer, got {seed!r}")


def _encoder(tokenizer):
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    return encode


def bos_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a text by itself (e.g. BOS), or []."""
    with_special = tokenizer("a").input_ids
    plain = tokenizer("a", add_special_tokens=False).input_ids
    n = len(with_special) - len(plain)
    return with_special[:n] if n > 0 and with_special[n:] == plain else []


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _batches(samples: list[Sample]) -> list[list[Sample]]:
    per = max(1, BATCH_TOKENS // max(len(s.ids) for s in samples))
    return [samples[i:i + per] for i in range(0, len(samples), per)]


class StepClock(BaseStreamer):
    """A streamer that only notes when ``generate`` hands over tokens: first the prompt, then each new token, so
    the gaps between the later hand-overs are the decode steps (one new token per sequence each)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_seconds(self) -> list[float]:
        """Seconds of each decode step after the first new token (the prefill is not one of them)."""
        return [b - a for a, b in zip(self.times[1:-1], self.times[2:], strict=True)]


@torch.no_grad()
def prompt_cache_bytes(model, ids: list[int]) -> int:
    """Bytes of the decode cache after a prefill of ``ids`` (one sequence): what ``generate`` keeps to go on from
    the prompt (a growing K/V cache for softmax; states, windows and sinks for the plugin's kernels)."""
    cache = new_cache(model)
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    kwargs[cache_kwarg(model)] = cache
    model(input_ids=torch.tensor([ids], device=_device(model)), use_cache=True, **kwargs)
    return cache_bytes(cache)


@torch.no_grad()
def _generate_scores(model, tokenizer, samples: list[Sample], max_new_tokens: int,
                     steps: list[float] | None = None) -> list[bool]:
    """Greedy continuation of each prompt; correct iff its first number equals the answer exactly. The seconds of
    each decode step (whole batch) are appended to ``steps``."""
    correct = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for batch in _batches(samples):
        ids = torch.tensor([s.ids for s in batch], device=_device(model))
        clock = StepClock()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, num_beams=1, streamer=clock)
        if steps is not None:
            steps.extend(clock.step_seconds())
        for s, row in zip(batch, out[:, ids.shape[1]:], strict=True):
            correct.append(exact_match(first_number(tokenizer.decode(row, skip_special_tokens=True)), s.answers[0]))
    return correct


@torch.no_grad()
def _teacher_scores(model, samples: list[Sample]) -> list[list[bool]]:
    """Per sample, per query span: every answer token is the argmax given the gold tokens before it."""
    out = []
    for batch in _batches(samples):
        ids = torch.tensor([s.ids for s in batch], device=_device(model))
        logits = model(input_ids=ids, use_cache=False).logits
        pred = logits.argmax(-1)
        for row, s in enumerate(batch):
            out.append([bool((pred[row, a - 1:b - 1] == ids[row, a:b]).all()) for a, b in s.extra["answer_spans"]])
    return out


@torch.no_grad()
def token_losses(model, ids: list[int]) -> torch.Tensor:
    """Next-token NLL of ``ids[1:]`` (fp32, ``[len(ids) - 1]``): entry t is the loss of token t + 1."""
    x = torch.tensor([ids], device=_device(model))
    logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")


def _score_cell(model, tokenizer, spec, metric: str, cell: list[Sample],
                cost: dict[str, Any]) -> dict[str, list[bool]]:
    """The cell's scores per metric, without a press; the decode steps' cost is added to ``cost``."""
    if spec.kind == "generate":
        steps: list[float] = []
        scores = {metric: _generate_scores(model, tokenizer, cell, spec.answer_digits + 4, steps)}
        cost["decode_ms_per_token"] = 1e3 * statistics.median(steps) if steps else None
        cost["decode_batch"] = len(_batches(cell)[0])
        return scores
    per_query = _teacher_scores(model, cell)
    return {spec.metrics[0]: [q[0] for q in per_query], spec.metrics[1]: [ok for q in per_query for ok in q]}


# ------------------------------------------------------------------------------------ with a KV-cache press
def _question_start(sample: Sample) -> int:
    if sample.question_start is None:
        raise ValueError("a press needs to know where each prompt's question starts (Sample.question_start); "
                         "this task's samples do not say")
    return sample.question_start


def press_answers(runner: PressRunner, cell: list[Sample], max_new_tokens: int) -> list[PressResult]:
    """Each prompt's context compressed by the press, then its question answered greedily."""
    return [runner.generate_prompt(s.ids, _question_start(s), max_new_tokens=max_new_tokens) for s in cell]


def _press_generate_scores(runner: PressRunner, tokenizer, cell: list[Sample],
                           max_new_tokens: int) -> tuple[list[bool], list[PressResult]]:
    results = press_answers(runner, cell, max_new_tokens)
    correct = [exact_match(first_number(tokenizer.decode(r.tokens, skip_special_tokens=True)), s.answers[0])
               for s, r in zip(cell, results, strict=True)]
    return correct, results


def _press_teacher_scores(runner: PressRunner, cell: list[Sample]) -> tuple[list[list[bool]], list[PressResult]]:
    """Per prompt, per query span: every answer token is the argmax given the gold tokens before it, with the
    context before ``question_start`` compressed."""
    out, results = [], []
    for s in cell:
        start = _question_start(s)
        result, pred = runner.predict(s.ids[:start], s.ids[start:])
        gold = torch.tensor(s.ids)
        pred = pred.cpu()  # pred[i]: the token after ids[start + i]
        out.append([bool((pred[a - 1 - start:b - 1 - start] == gold[a:b]).all()) for a, b in s.extra["answer_spans"]])
        results.append(result)
    return out, results


def press_cost(runner: PressRunner, results: list[PressResult]) -> dict[str, Any]:
    """What a cell cost with the press: ``cache_bytes``, the K/V bytes left after the context (mean over the
    cell's prompts), the ``press``, the ``compression`` ratio used (mean: with a byte target each prompt gets its
    own) and the byte target ``press_bytes`` (None with a fixed ratio)."""
    return {"cache_bytes": round(statistics.fmean(r.cache_bytes for r in results)), "press": runner.name,
            "compression": statistics.fmean(r.compression_ratio for r in results),
            "press_bytes": runner.target_bytes}


def score_with_press(runner: PressRunner, tokenizer, spec: LongContextTask, metric: str,
                     cell: list[Sample]) -> tuple[dict[str, list[bool]], dict[str, Any]]:
    """The cell's scores per metric, each prompt split at its ``question_start``: the context before it prefilled
    under the press, then the question asked after the compressed context as kvpress's ``kv-press-text-generation``
    pipeline asks it: a greedy answer (``generate`` tasks, scored as without a press) or one teacher-forced pass
    over the queries (``teacher`` tasks); and what the cell cost (:func:`press_cost`)."""
    if spec.kind == "generate":
        correct, results = _press_generate_scores(runner, tokenizer, cell, spec.answer_digits + 4)
        return {metric: correct}, press_cost(runner, results)
    if spec.kind == "teacher":
        per_query, results = _press_teacher_scores(runner, cell)
        return ({spec.metrics[0]: [q[0] for q in per_query], spec.metrics[1]: [ok for q in per_query for ok in q]},
                press_cost(runner, results))
    raise ValueError(f"a press cannot run {spec.name!r}: it has no question to ask after a compressed context "
                     "(presses run the generate and teacher-forced tasks: passkey, niah, kv_recall)")


@dataclasses.dataclass(frozen=True)
class LongContextGrid:
    """The cells a long-context task is scored on (every length × depth) and the prompts of each cell."""

    lengths: Sequence[int] = DEFAULT_LENGTHS  # prompt lengths, tokens
    depths: Sequence[float] = DEFAULT_DEPTHS  # needle depths, percent of the haystack
    samples: int = DEFAULT_SAMPLES  # prompts per (length, depth) cell
    seed: int = 0  # of the prompts (the same seed gives the same prompts)

    def check(self) -> None:
        """ValueError naming the bad value (:func:`check_long_context_args`)."""
        check_long_context_args(self.lengths, self.depths, self.samples, self.seed)


def run_long_context(model, tokenizer, task: str, grid: LongContextGrid | None = None, *, text: str | None = None,
                     progress=None, press: PressRunner | None = None) -> list[dict[str, Any]]:
    """Score ``task`` on every (length, depth) cell of ``grid`` (default: :class:`LongContextGrid`'s defaults);
    returns ``[{"metric", "value", "stderr", "n", "length", "depth", "seconds", "cache_bytes", ...}]``
    (position_loss: one per position bucket, ``length`` = the bucket's end, ``depth`` None, plus
    ``position_start``). Every recall cell carries what it cost: ``cache_bytes``, the decode cache after one
    prompt of the cell (one sequence, measured by a separate prefill of the cell's first prompt), and for
    generated answers ``decode_ms_per_token``, the median decode step while answering, with ``decode_batch``
    sequences per step. ``text``: the natural filler text of the tasks that need one. ``press``: a
    :class:`~hf_kernel_attn.evaluation.presses.PressRunner` on ``model`` (the unconverted softmax model): each
    prompt's context is compressed by it before its question (:func:`score_with_press`); the cells then carry ``press``,
    ``compression``, ``press_bytes`` and ``cache_bytes``, the K/V bytes after the context (mean over the cell)."""
    grid = grid or LongContextGrid()
    lengths, depths, samples, seed = grid.lengths, grid.depths, grid.samples, grid.seed
    if task not in TASKS:
        raise ValueError(f"unknown long-context task {task!r}; available: {sorted(TASKS)}")
    grid.check()
    spec = TASKS[task]
    encode, bos = _encoder(tokenizer), bos_ids(tokenizer)
    natural = None
    if spec.needs_text:
        if text is None:
            raise ValueError(f"{task} needs natural filler text (--data-dir with {TEXT_TASK})")
        natural = TokenizedText(tokenizer, text)
    if press is not None and spec.kind == "loss":
        raise ValueError(f"a press cannot run {task!r}: it scores every position of one text, with no question to "
                         "ask after a compressed context")
    results = []
    if spec.kind == "loss":
        start = time.perf_counter()
        longest = max(lengths)
        seqs = spec.samples(encode, longest, 0, samples, seed, text_ids=natural.ids, bos=bos)
        losses = torch.stack([token_losses(model, s.ids) for s in seqs])  # [samples, longest - 1]
        secs = time.perf_counter() - start
        for lo, hi in buckets(list(lengths)):
            part = losses[:, lo:hi - 1] if lo == 0 else losses[:, lo - 1:hi - 1]  # targets at positions lo..hi-1
            per_seq = part.mean(1)
            se = float(per_seq.std() / len(per_seq) ** 0.5) if len(per_seq) > 1 else None
            results.append({"metric": "loss", "value": float(part.mean()), "stderr": se, "n": len(seqs),
                            "length": hi, "depth": None, "position_start": lo, "seconds": secs})
        return results
    for metric in spec.metrics if spec.kind == "generate" else (spec.metrics[0],):
        for length in lengths:
            for depth in depths:
                kwargs = {"text_ids": natural} if natural else {}  # niah reads its sentence starts
                cell = spec.samples(encode, length, depth, samples, seed, metric=metric, bos=bos, **kwargs)
                cost: dict[str, Any]
                if press is not None:
                    start = time.perf_counter()
                    scores, cost = score_with_press(press, tokenizer, spec, metric, cell)
                else:
                    cost = {"cache_bytes": prompt_cache_bytes(model, cell[0].ids)}
                    start = time.perf_counter()  # the scoring alone
                    scores = _score_cell(model, tokenizer, spec, metric, cell, cost)
                secs = time.perf_counter() - start
                for name, correct in scores.items():
                    results.append({"metric": name, "value": 100 * sum(correct) / len(correct),
                                    "stderr": 100 * accuracy_stderr(correct), "n": len(correct), "length": length,
                                    "depth": depth, "seconds": secs, **cost})
                if progress:
                    progress(task, metric, length, depth, scores, secs, cost)
    return results


def read_filler_text(data_dir, split: str) -> str:
    return read_text_task(TEXT_TASK, split, data_dir)

