"""RULER's synthetic long-context tasks run through lm-evaluation-harness's own task configs.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?") builds
prompts of a given token length from templates and scores the greedy answer by string match. lm-eval ships it
(task folder ``ruler``); the tasks here are the ones whose haystack is generated locally, so they run offline:

==================  ==============================================================================
``niah_single_1``   one 7-digit "special magic number" for a key, in repeated filler sentences
``niah_multikey_2`` the same, among many distractor needle lines with other keys
``niah_multikey_3`` the same with UUID keys and values
``ruler_vt``        variable tracking: every variable a chain of assignments gives one value
``ruler_cwe``       common-word extraction: the 10 most frequent words of a numbered list
``ruler_fwe``       frequent-word extraction: the 3 most frequent words of a coded text
==================  ==============================================================================

(RULER's essay haystacks and QA tasks download their text, so they are left out.)

Each length is a separate lm-eval run (``metadata: max_seq_lengths: [L]``), so ``limit`` prompts are scored at
every length (lm-eval's ``--limit`` alone would take the first prompts of the first length). The prompts are
sized with the model's own tokenizer, saved to a scratch folder and named to lm-eval as ``tokenizer``; the score
is lm-eval's (the share of expected strings found in the answer), reported in percent as the ``score`` metric.

With a KV-cache press (:class:`~hf_kernel_attn.evaluation.presses.PressRunner`) each prompt is split before its
question, the **last line of the prompt** (for all six tasks the question and lm-eval's answer prefix follow the
last newline): the context before it is compressed, then the question is asked and answered greedily, as for the
project's own long-context tasks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..long_context.runner import press_cost, prompt_cache_bytes
from ..presses import PressResult, PressRunner
from ..task import EvalOptions, EvalRun, EvalTask

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
SCORE = "score"  # lm-eval's string-match score of a length, in percent


def question_start(ids: list[int], tokenizer) -> int:
    """Index of the first token after the prompt's last newline (the question line); ValueError when no token
    before the last one holds a newline."""
    for i in range(len(ids) - 2, -1, -1):
        if "\n" in tokenizer.decode([ids[i]]):
            return i + 1
    raise ValueError("the prompt has no newline before its last token: no question line to keep out of the press")


@functools.cache
def _lm_classes():
    """lm-eval's HFLM and a subclass that answers through a KV-cache press (lm-eval: optional, imported when a
    RULER task runs)."""
    from lm_eval.models.huggingface import HFLM

    class PressHFLM(HFLM):
        """HFLM whose generation prefills each prompt's context under ``press`` (a PressRunner), then answers the
        question line greedily until EOS (lm-eval cuts the answer at its stop strings afterwards)."""

        def __init__(self, *args: Any, press: PressRunner, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.press, self.press_results = press, []

        def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
            if context.shape[0] != 1:
                raise ValueError("a press answers one prompt at a time: batch_size 1")
            ids = context[0].tolist()
            start = question_start(ids, self.tokenizer)
            result: PressResult = self.press.generate(ids[:start], ids[start:], max_new_tokens=max_length - len(ids),
                                                      eos_token_id=self.tokenizer.eos_token_id)
            self.press_results.append(result)
            return torch.tensor([ids + result.tokens], device=context.device)

    return HFLM, PressHFLM


@dataclasses.dataclass
class RulerScore:
    """One task at one length: the ``score`` (percent), the prompts scored, seconds, what a prompt's cache cost
    (``cache_bytes``; with a press also ``press``, ``compression`` and ``press_bytes``) and the ``answers`` as
    lm-eval scored them (cut at its stop strings), in prompt order."""

    value: float
    n: int
    seconds: float
    cost: dict[str, Any]
    answers: list[str]


def ruler_task_manager(tokenizer_dir: str | os.PathLike, length: int):
    """lm-eval's TaskManager over its ``ruler`` task folder only (indexing every built-in task costs tens of
    seconds), with the metadata that sizes the prompts: the tokenizer's folder and ``max_seq_lengths: [length]``."""
    import lm_eval  # optional and heavy: only when lm-eval runs
    from lm_eval.tasks import TaskManager

    folder = Path(lm_eval.__file__).parent / "tasks" / "ruler"
    return TaskManager(include_path=str(folder), include_defaults=False,
                       metadata={"tokenizer": str(tokenizer_dir), "max_seq_lengths": [int(length)]})


def run_ruler(model, tokenizer, task: str, length: int, limit: int, *, press: PressRunner | None = None,
              batch_size: int = 1) -> RulerScore:
    """Score ``task`` (one of :data:`RULER_TASKS`) on ``limit`` prompts of ``length`` tokens through lm-eval's
    ``simple_evaluate`` on the in-memory ``model``; ``press``: on the unconverted model, each context compressed
    before its question."""
    from lm_eval import simple_evaluate  # optional and heavy: only when lm-eval runs

    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; available: {list(RULER_TASKS)}")
    hflm, press_hflm = _lm_classes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_kernel_attn-ruler-tokenizer-") as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        if press is None:
            lm = hflm(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        else:
            lm = press_hflm(pretrained=model, tokenizer=tokenizer, batch_size=1, press=press)
        manager = ruler_task_manager(tok_dir, length)
        out = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, num_fewshot=0,
                              log_samples=True, bootstrap_iters=0)
    seconds = time.perf_counter() - start
    value = out["results"][task][f"{int(length)},none"]
    samples = out["samples"][task]
    if press is not None:
        cost = press_cost(press, lm.press_results)
    else:
        prompt = samples[0]["arguments"][0][0] if samples else ""
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        cost = {"cache_bytes": prompt_cache_bytes(model, ids)}
    answers = [s["filtered_resps"][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
    return RulerScore(100.0 * float(value), len(samples), seconds, cost, answers)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RulerTask(EvalTask):
    """A RULER task by lm-eval's name, scored at every length of ``--lengths`` on ``--limit`` prompts each
    (``--samples`` when no limit is given); records carry ``length`` and the cache a prompt cost."""

    name: str
    model_kind = "causal_lm"
    main_metric = SCORE
    by_length = True
    takes_press = True

    def files(self, split: str) -> list[str]:
        return []  # generated from templates

    def check_options(self, options: EvalOptions) -> None:
        bad = [n for n in options.lengths if isinstance(n, bool) or not isinstance(n, int) or n < 256]
        if bad:
            raise ValueError(f"{self.name}: lengths must be integers >= 256 (RULER sizes its prompts to them), "
                             f"got {bad}")

    def prompts(self, run: EvalOptions) -> int:
        """Prompts scored per length: ``limit``, else ``samples``."""
        return int(run.limit) if run.limit is not None else int(run.samples)

    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        return self.run_with_press(run, None)

    def run_with_press(self, run: EvalRun, press: PressRunner | None) -> list[dict[str, Any]]:
        records = []
        for length in run.lengths:
            score = run_ruler(run.model, run.tokenizer, self.name, int(length), self.prompts(run), press=press,
                              batch_size=run.batch_size)
            rec = run.record(SCORE, score.value, None, score.n, score.seconds)
            rec.update(length=int(length), depth=None, **score.cost)
            records.append(rec)
            paid = f"cache {score.cost['cache_bytes'] / 2**20:.1f} MiB"
            print(f"{self.name} length {length}: {score.value:.1f} on {score.n} prompts ({paid}; "
                  f"{score.seconds:.1f} s)", flush=True)
        return records


TASKS: tuple[RulerTask, ...] = tuple(RulerTask(name) for name in RULER_TASKS)  # registered by evaluation.tasks
