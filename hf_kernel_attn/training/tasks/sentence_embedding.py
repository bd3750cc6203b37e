"""Sentence embeddings: cosine distillation of the original (softmax) model's mean-pooled embedding of each
training sentence, computed once before training; held-out Spearman ×100 on scored pairs (STS-B)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ...evaluation.families.embedding import mean_pool
from ...integration.transfer import softmax_teacher
from ..data import BatchPlan, sentences
from .base import TrainingTask, register_task


@register_task
class SentenceEmbeddingTask(TrainingTask):
    name = "sentence_embedding"
    auto_class = "AutoModel"
    hub_task = "sentence-similarity"
    extra_keys = ("teacher_index",)
    unused_modules = ("pooler",)  # the loss mean-pools last_hidden_state

    def load_data(self) -> tuple[Any, Any]:
        return sentences(self.context.config)

    def batch(self, items: Any, idx: list[int]) -> tuple[dict[str, Any], int]:
        enc = self.context.encode([items[i] for i in idx])
        enc["teacher_index"] = idx
        return enc, int(enc["attention_mask"].sum())

    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        emb = mean_pool(model(**self.inputs(batch)).last_hidden_state, batch["attention_mask"])
        target = self.teacher[batch["teacher_index"]].to(emb.device)
        return (1 - torch.nn.functional.cosine_similarity(emb.float(), target, dim=-1)).mean()

    def validate(self, model: torch.nn.Module, rows: Any, batch_size: int) -> dict[str, float]:
        if isinstance(rows[0], str):
            return {}  # plain sentences: no gold similarity scores
        sims, gold = [], []
        for s in range(0, len(rows), batch_size):
            part = rows[s:s + batch_size]
            a, b = self._embed(model, [r.text_a for r in part]), self._embed(model, [r.text_b for r in part])
            sims += torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
            gold += [float(r.label) for r in part]
        from scipy.stats import spearmanr

        return {"val_spearman": 100 * float(spearmanr(sims, gold).statistic)}

    def save_extras(self, source: Path, target: Path) -> None:
        copy_sentence_transformers_files(source, target)

    def calibration_batch(self, rows: Any) -> dict[str, Any]:
        return dict(self.context.encode([r if isinstance(r, str) else r.text_a for r in rows]))

    def _embed(self, model: torch.nn.Module, texts: list[str]) -> torch.Tensor:
        enc = self.context.encode(texts)
        return mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]).float()

    @torch.no_grad()
    def before_training(self) -> None:
        """The original model's pooled embedding of every training sentence the run will read (``self.teacher``)."""
        if hasattr(self, "teacher"):
            return
        t = self.context
        data = t.config["data"]
        total = sum(s["steps"] for s in t.config["stages"].values()) * data["grad_accum"]
        plan = BatchPlan(t.plan.n, t.plan.seed, t.plan.global_batch)  # every rank's samples
        needed = sorted({i for j in range(total) for i in plan.indices(j * plan.global_batch)})
        self.teacher = torch.zeros(len(t.train), t.model.config.hidden_size)
        was_training = t.model.training
        t.model.eval()
        bs = max(data["batch_size"], 32)
        with softmax_teacher():
            for start in range(0, len(needed), bs):
                idx = needed[start:start + bs]
                enc = t.encode([t.train.items[i] for i in idx])
                out = t.model(**enc).last_hidden_state
                self.teacher[idx] = mean_pool(out, enc["attention_mask"]).float().cpu()
        t.model.train(was_training)


def copy_sentence_transformers_files(source: Path, target: Path) -> None:
    """Keep a sentence-transformers model usable as one: its pooling/normalisation module files."""
    if not source.is_dir():
        return
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    for sub in source.iterdir():
        if sub.is_dir() and sub.name[:1].isdigit() and "_" in sub.name:
            shutil.copytree(sub, target / sub.name, dirs_exist_ok=True)
    # every module folder modules.json names exists, even one without files of its own (Normalize)
    for path in _module_paths(source / "modules.json"):
        (target / path).mkdir(parents=True, exist_ok=True)


def _module_paths(modules_json: Path) -> list[str]:
    """The non-empty relative ``path`` entries of a sentence-transformers ``modules.json`` (none if absent)."""
    if not modules_json.is_file():
        return []
    try:
        entries = json.loads(modules_json.read_text())
    except ValueError as exc:
        raise ValueError(f"{modules_json} is not valid JSON ({exc}); it should list the sentence-transformers "
                         "modules") from exc
    paths = []
    for entry in entries if isinstance(entries, list) else []:
        path = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(path, str) and path and not Path(path).is_absolute() and ".." not in Path(path).parts:
            paths.append(path)
    return paths
