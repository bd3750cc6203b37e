"""Perplexity tasks: one text stream per split (local files, or a hub dataset), scored with strided windows
(:func:`~hf_kernel_attn.evaluation.perplexity.strided_perplexity`): ``perplexity`` and ``bits_per_byte``."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from ...data.files import read_text_file
from ..perplexity import strided_perplexity
from ..task import EVAL_TASKS, EvalRun, EvalTask, check_split

TINYSHAKESPEARE_HOLDOUT = 0.05  # `validation` = the last 5% of train.txt (what `finetune` holds out)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TextTask(EvalTask):
    """A plain-text perplexity task: a local file per split (``files``), or a hub dataset (``hub``: path,
    config, split pattern, text column); ``holdout_tail``: the fraction at the end of a split's file that is
    read (a held-out tail of a training file)."""

    name: str
    files_by_split: dict[str, str]
    hub: tuple[str, str | None, str, str]
    holdout_tail: dict[str, float] = dataclasses.field(default_factory=dict)
    model_kind = "causal_lm"
    main_metric = "perplexity"
    lower_is_better = True

    def files(self, split: str) -> list[str]:
        return [self.files_by_split[split]]

    def read(self, split: str, data_dir: str | os.PathLike | None) -> str:
        """The evaluation text of ``split`` (one stream); ``data_dir`` None reads the hub dataset."""
        check_split(split)
        if data_dir is None:
            import datasets  # optional and heavy: only for the hub

            path, config, hub_split, column = self.hub
            try:
                rows = datasets.load_dataset(path, config, split=hub_split.format(split=split))[column]
            except Exception as exc:
                raise RuntimeError(f"cannot read {self.name} ({path}) from the hub: {exc}; pass --data-dir") from exc
            return "\n".join(rows)
        path = Path(data_dir) / self.files_by_split[split]
        if not path.is_file():
            raise FileNotFoundError(f"{self.name} --split {split}: expected the file {str(path)!r} "
                                    "(see EVAL_SPLITS.md)")
        text = read_text_file(path, f"{self.name} --split {split} data file")
        tail = self.holdout_tail.get(split)
        text = text[len(text) - int(len(text) * tail):] if tail else text
        if not text.strip():
            raise ValueError(f"{self.name} --split {split}: the text read from {str(path)!r} is empty "
                             f"({len(text)} characters, no tokens to score)")
        return text

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        self.read(split, data_dir)

    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        start = time.perf_counter()
        text = self.read(run.split, run.data_dir)
        res = strided_perplexity(run.model, run.tokenizer, text, context=run.context, stride=run.stride,
                                 limit=run.limit, batch_size=run.batch_size)
        secs = time.perf_counter() - start
        return [run.record("perplexity", res["perplexity"], None, res["tokens"], secs),
                run.record("bits_per_byte", res["bits_per_byte"], None, res["tokens"], secs)]


TASKS: tuple[TextTask, ...] = (  # the built-in text tasks (registered by evaluation.tasks)
    TextTask("wikitext2", {"validation": "wikitext-2-raw/wiki.valid.raw", "test": "wikitext-2-raw/wiki.test.raw"},
             ("Salesforce/wikitext", "wikitext-2-raw-v1", "{split}", "text")),
    TextTask("ptb", {"validation": "ptb/ptb.valid.txt", "test": "ptb/ptb.test.txt"},
             ("ptb-text-only/ptb_text_only", None, "{split}", "sentence")),
    TextTask("tinyshakespeare", {"validation": "tinyshakespeare/train.txt", "test": "tinyshakespeare/val.txt"},
             ("karpathy/tiny_shakespeare", None, "{split}", "text"),
             holdout_tail={"validation": TINYSHAKESPEARE_HOLDOUT}),
)


def text_task(name: str) -> TextTask:
    """The perplexity task ``name``: the registered one, else the built-in one (this module used on its own);
    ValueError naming the perplexity tasks otherwise."""
    task = EVAL_TASKS.get(name) if name in EVAL_TASKS else {t.name: t for t in TASKS}.get(name)
    if not isinstance(task, TextTask):
        names = [n for n, t in EVAL_TASKS.items() if isinstance(t, TextTask)] or [t.name for t in TASKS]
        raise ValueError(f"{name!r} is not a text (perplexity) task; text tasks: {names}")
    return task


def read_text_task(task: str, split: str, data_dir: str | os.PathLike | None) -> str:
    """The evaluation text of the perplexity task ``task`` (one stream): :meth:`TextTask.read`."""
    return text_task(task).read(split, data_dir)
