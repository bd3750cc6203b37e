"""The long-context tasks of :mod:`hf_kernel_attn.evaluation.long_context` (passkey, niah, kv_recall,
position_loss) as evaluation tasks: every (length, depth) cell of the grid is scored, one record per (metric,
length, depth), with ``length``, ``depth``, ``seed`` and what the cell cost (``cache_bytes``,
``decode_ms_per_token``, ``decode_batch``; with a KV-cache press: ``press``, ``compression``, ``press_bytes`` and
``cache_bytes`` after the compressed context)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..long_context import TASKS as LONG_TASKS
from ..long_context import LongContextTask
from ..long_context.runner import (
    TEXT_TASK,
    LongContextGrid,
    check_long_context_args,
    read_filler_text,
    run_long_context,
)
from ..presses import PressRunner
from ..task import EvalOptions, EvalRun, EvalTask
from .text import text_task

LONG_CONTEXT_KEYS = ("length", "depth")  # added to the records of long-context tasks
COST_KEYS = ("cache_bytes", "decode_ms_per_token", "decode_batch")  # what a recall cell cost (long_context.runner)
PRESS_KEYS = ("press", "compression", "press_bytes")  # the KV-cache press a cell ran with (long_context.runner)


def _progress(task: str, metric: str, length: int, depth: float, scores: dict[str, list[bool]], secs: float,
              cost: dict[str, Any]) -> None:
    """One line per scored cell: the accuracy of each metric, what the cell cost, how long it took."""
    ms = cost.get("decode_ms_per_token")
    paid = f"cache {cost['cache_bytes'] / 2**20:.1f} MiB" + ("" if ms is None else f", {ms:.0f} ms/token")
    if cost.get("press") is not None:
        paid = f"press {cost['press']} ratio {cost['compression']:.3f}, {paid} after the context"
    print(f"{task} {metric} length {length} depth {depth}: "
          + ", ".join(f"{k} {100 * sum(v) / len(v):.0f}%" for k, v in scores.items()) + f" ({paid}; {secs:.1f} s)",
          flush=True)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class LongContextEvalTask(EvalTask):
    """The registered long-context task ``name`` (:data:`~hf_kernel_attn.evaluation.long_context.TASKS`); its
    main metric is the task's first metric, lower is better for a loss."""

    name: str
    model_kind = "causal_lm"
    by_length = True

    @property
    def spec(self) -> LongContextTask:
        """The long-context task itself (prompts and scoring)."""
        return LONG_TASKS[self.name]

    @property
    def main_metric(self) -> str:  # type: ignore[override]
        return self.spec.metrics[0]

    @property
    def lower_is_better(self) -> bool:  # type: ignore[override]
        return self.spec.kind == "loss"

    @property
    def needs_text(self) -> bool:
        """Whether the prompts are built from natural text (wikitext2's file of the split)."""
        return self.spec.needs_text

    def files(self, split: str) -> list[str]:
        return text_task(TEXT_TASK).files(split) if self.needs_text else []

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        if self.needs_text:
            read_filler_text(data_dir, split)

    def check_options(self, options: EvalOptions) -> None:
        check_long_context_args(list(options.lengths), list(options.depths), options.samples, options.seed)

    @property
    def takes_press(self) -> bool:
        """Whether a KV-cache press can run it: a question asked after a context (not a loss by position)."""
        return self.spec.kind != "loss"

    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        return self.run_with_press(run, None)

    def run_with_press(self, run: EvalRun, press: PressRunner | None) -> list[dict[str, Any]]:
        """:meth:`run`, each prompt's context compressed by ``press`` (on ``run.model``) before its question."""
        text = read_filler_text(run.data_dir, run.split) if self.needs_text else None
        grid = LongContextGrid(run.lengths, run.depths, run.samples, run.seed)
        cells = run_long_context(run.model, run.tokenizer, self.name, grid, text=text, progress=_progress,
                                 press=press)
        out = []
        for c in cells:
            rec = run.record(c["metric"], c["value"], c["stderr"], c["n"], c["seconds"])
            rec.update(length=c["length"], depth=c["depth"], seed=run.seed)
            rec.update({key: c[key] for key in ("position_start", *COST_KEYS, *PRESS_KEYS) if key in c})
            out.append(rec)
        return out


# the built-ins (registered by evaluation.tasks): one per task of the long-context registry, in its order
TASKS: tuple[LongContextEvalTask, ...] = tuple(LongContextEvalTask(name) for name in LONG_TASKS)
