"""An evaluation task defined outside the package, through the public API only (``EvalTask`` +
``register_eval_task``): the mean next-token loss of each line of ``lines/<split>.txt`` under ``--data-dir``
(main metric ``mean_nll``, lower is better) and the perplexity of those tokens.
tests/evaluation/test_eval_tasks.py names this module with ``--import`` and in a leaderboard's ``imports:``."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from hf_kernel_attn.evaluation.tasks import EvalRun, EvalTask, register_eval_task

NAME = "line_loss"


def read_lines(data_dir: str | os.PathLike | None, split: str) -> list[str]:
    """The non-blank lines of ``lines/<split>.txt``; ValueError naming the file when there are none."""
    if data_dir is None:
        raise ValueError(f"{NAME} reads local files only: pass --data-dir")
    path = Path(data_dir) / "lines" / f"{split}.txt"
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{NAME} --split {split}: {str(path)!r} holds no lines")
    return lines


@register_eval_task
class LineLoss(EvalTask):
    name = NAME
    model_kind = "causal_lm"
    main_metric = "mean_nll"
    lower_is_better = True

    def files(self, split: str) -> list[str]:
        return [f"lines/{split}.txt"]

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        read_lines(data_dir, split)

    @torch.no_grad()
    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        start = time.perf_counter()
        lines = read_lines(run.data_dir, run.split)[: run.limit or None]
        per_line, total, tokens = [], 0.0, 0
        for line in lines:
            ids = run.tokenizer(line, return_tensors="pt").input_ids
            loss = float(run.model(ids, labels=ids).loss)
            per_line.append(loss)
            total += loss * (ids.shape[1] - 1)
            tokens += ids.shape[1] - 1
        mean = sum(per_line) / len(per_line)
        se = (math.sqrt(sum((x - mean) ** 2 for x in per_line) / (len(per_line) - 1) / len(per_line))
              if len(per_line) > 1 else None)
        secs = time.perf_counter() - start
        # the secondary metric first: the leaderboard must pick the main one by name, not by position
        return [run.record("perplexity", math.exp(total / tokens), None, tokens, secs),
                run.record("mean_nll", mean, se, len(lines), secs)]
