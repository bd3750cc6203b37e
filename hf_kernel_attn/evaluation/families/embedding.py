"""Zero-shot sentence-embedding similarity: mean-pooled last hidden states of a bare encoder, cosine
similarity of each pair against the gold score (Spearman ×100), on STS-B's pairs."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from ...data import load_glue
from ..metrics import load_metric
from ..task import EvalRun, EvalTask
from .glue import check_glue_rows, glue_files

BATCH_SIZE = 32  # at least this many sentences per forward


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_i m_i h_i / Σ_i m_i over tokens (sentence-transformers' mean pooling, as all-MiniLM-L6-v2 uses)."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


@torch.no_grad()
def embed(model, tok, texts: list[str], batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled last hidden states of ``texts``."""
    out = []
    for s in range(0, len(texts), batch_size):
        enc = tok(texts[s:s + batch_size], padding=True, truncation=True, max_length=512, return_tensors="pt")
        out.append(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]).float())
    return torch.cat(out)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class EmbeddingTask(EvalTask):
    """Cosine similarity of the embeddings of a GLUE pair task's sentences (``glue``) against its gold score."""

    name: str
    glue: str = "stsb"
    model_kind = "embedding"
    main_metric = "spearman"
    hub_task_type = "sentence-similarity"

    def files(self, split: str) -> list[str]:
        return glue_files(self.glue, split)

    def check_data(self, split: str, data_dir: str | os.PathLike) -> None:
        check_glue_rows(self.name, self.glue, split, data_dir)

    def run(self, run: EvalRun) -> list[dict[str, Any]]:
        start = time.perf_counter()
        rows = load_glue(self.glue, run.split, run.data_dir)[: run.limit or None]
        batch_size = max(run.batch_size, BATCH_SIZE)
        a = embed(run.model, run.tokenizer, [r.text_a for r in rows], batch_size)
        b = embed(run.model, run.tokenizer, [r.text_b for r in rows], batch_size)
        sims = torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
        spear = load_metric("spearmanr").compute(predictions=sims, references=[r.label for r in rows])["spearmanr"]
        secs = time.perf_counter() - start
        return [run.record("spearman", 100 * spear, None, len(rows), secs)]


TASKS: tuple[EmbeddingTask, ...] = (EmbeddingTask("stsb_embedding"),)  # the built-ins (registered by evaluation.tasks)
