"""Training data: packed token blocks (causal LM), labelled GLUE pairs, sentences (embeddings).

Every source keeps a held-out slice for validation: the end of each text file, or every 10th row
of a GLUE file (the rule of :func:`hf_kernel_attn.data.load_glue`). Batches come from a
:class:`BatchPlan`, a pure function of (seed, sample position), so a resumed run reads exactly the
samples the uninterrupted run would have read, and ``accelerate launch`` with P processes reads the
same global batch as one process (each rank takes its slice of every global micro-batch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.files import read_text_file
from ..data.glue import holdout, load_glue, read_glue_file
from .recall_data import with_recall_facts

HOLDOUT_EVERY = 10


def _is_local(item: str) -> bool:
    return os.path.sep in item or item.startswith(".") or Path(item).exists()


def _train_files(train: str | list[str]) -> list[Path] | str:
    """Local files (checked) or a hub dataset id."""
    if isinstance(train, str) and not _is_local(train):
        return train
    items = [train] if isinstance(train, str) else list(train)
    files = [Path(f) for f in items]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"data.train: file(s) not found: {missing}")
    return files


def _read(path: Path) -> str:
    return read_text_file(path, "data.train file", allow_empty=False)


def check_training_data(config: dict[str, Any], *, glue_rows: bool) -> None:
    """Before the model loads: every local ``data.train`` file exists and is non-empty UTF-8 text, and
    GLUE files (``data.glue_task``, read as labelled rows when ``glue_rows``: a task that is not a language
    model) have the task's columns and valid labels; errors name the file."""
    data = config["data"]
    source = _train_files(data["train"])
    if isinstance(source, str):
        return  # a hub dataset: read (and checked) by datasets
    if data["glue_task"] and glue_rows:

        for f in source:
            if not read_glue_file(data["glue_task"], f):
                raise ValueError(f"data.train file {str(f)!r} holds no {data['glue_task']} examples")
    else:
        for f in source:
            _read(f)


@dataclass
class Split:
    """One split of one task: ``items`` are token blocks (LongTensor [n, L]) or examples."""

    items: Any

    def __len__(self) -> int:
        return len(self.items)


def text_blocks(config: dict[str, Any], tokenizer) -> tuple[Split, Split]:
    """Tokenise each training text (EOS between files), hold out the last ``validation_fraction`` of
    each, and pack both parts into ``seq_len`` blocks (a final partial block is dropped); with
    ``recall_fraction`` that share of the training blocks carries recall facts (:mod:`.recall_data`)."""
    data = config["data"]
    seq_len = data["seq_len"]
    source = _train_files(data["train"])
    if isinstance(source, str):
        import datasets

        try:
            texts = datasets.load_dataset(source, split="train")[data["text_column"]]
        except Exception as exc:  # offline, unknown id, missing column
            raise RuntimeError(f"cannot read hub dataset {source!r} (column {data['text_column']!r}): {exc}; "
                               "pass local files in data.train instead") from exc
        texts = ["\n".join(texts)]
    else:
        limit = data["max_train_chars"]
        texts = [_read(f)[:limit] if limit else _read(f) for f in source]
    train_ids, valid_ids = [], []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        cut = len(ids) - int(len(ids) * data["validation_fraction"])
        train_ids += ids[:cut]
        valid_ids += ids[cut:]

    def pack(ids: list[int]) -> torch.Tensor:
        n = len(ids) // seq_len
        return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)

    train, valid = pack(train_ids), pack(valid_ids)
    if len(train) == 0:
        raise ValueError(f"data.train holds {len(train_ids)} training tokens, fewer than one block of "
                         f"data.seq_len={seq_len}")
    if data["recall_fraction"]:
        train = with_recall_facts(train, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                                  fraction=data["recall_fraction"], max_facts=data["recall_max_facts"],
                                  style=data["recall_style"],
                                  seed=config["seed"])
    return Split(train), Split(valid)


def glue_examples(config: dict[str, Any]) -> tuple[Split, Split]:
    """Rows of the GLUE files in ``data.train`` (``data.glue_task`` layout); every 10th row held out."""
    task = config["data"]["glue_task"]
    source = _train_files(config["data"]["train"])
    if isinstance(source, str):
        return Split(load_glue(task, "train")), Split(load_glue(task, "validation"))
    rows = [ex for f in source for ex in read_glue_file(task, f)]
    return Split(holdout(rows, HOLDOUT_EVERY, held=False)), Split(holdout(rows, HOLDOUT_EVERY, held=True))


def sentences(config: dict[str, Any]) -> tuple[Split, Split]:
    """Sentence-embedding data: with ``data.glue_task`` the sentences of the training pairs (validation
    keeps the held-out pairs with their scores); otherwise the non-empty lines of the text files."""
    if config["data"]["glue_task"]:
        train, valid = glue_examples(config)
        texts = []
        for ex in train.items:
            texts.append(ex.text_a)
            if ex.text_b:
                texts.append(ex.text_b)
        return Split(texts), valid
    source = _train_files(config["data"]["train"])
    if isinstance(source, str):
        raise ValueError("sentence_embedding from a hub dataset needs data.glue_task (e.g. stsb)")
    lines = [ln.strip() for f in source for ln in _read(f).splitlines() if ln.strip()]
    cut = len(lines) - int(len(lines) * config["data"]["validation_fraction"])
    return Split(lines[:cut]), Split(lines[cut:])


class BatchPlan:
    """Which samples each rank reads: epoch e visits a permutation drawn from (seed, e); global
    micro-batch j covers positions [j·G, (j+1)·G) with G = batch_size × world, rank r takes its slice."""

    def __init__(self, num_items: int, seed: int, batch_size: int, world: int = 1, rank: int = 0) -> None:
        if num_items <= 0:
            raise ValueError("no training samples")
        self.n, self.seed, self.batch_size, self.world, self.rank = num_items, seed, batch_size, world, rank
        self._perm: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = {epoch: torch.randperm(self.n, generator=gen)}
        return self._perm[epoch]

    def indices(self, position: int) -> list[int]:
        """This rank's sample indices of the global micro-batch starting at sample ``position``."""
        start = position + self.rank * self.batch_size
        return [int(self._order(p // self.n)[p % self.n]) for p in range(start, start + self.batch_size)]


class PlanBatches(torch.utils.data.Sampler):
    """The global micro-batches of a :class:`BatchPlan` (every rank's samples) from sample ``start`` on,
    without end: the batch sampler of the training ``DataLoader``. ``accelerator.prepare`` with
    ``split_batches=True`` gives rank r the r-th contiguous slice of each, the slice ``BatchPlan(world, rank)``
    names, so P processes read what one process reads and a resumed run restarts at its checkpoint's sample."""

    def __init__(self, plan: BatchPlan, start: int) -> None:
        self.plan = BatchPlan(plan.n, plan.seed, plan.global_batch)
        self.batch_size, self.start = plan.global_batch, start

    def __iter__(self):
        position = self.start
        while True:
            yield self.plan.indices(position)
            position += self.batch_size


class SampleIndex(torch.utils.data.Dataset):
    """Item i is i: the collate function turns a batch's indices into model inputs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i
