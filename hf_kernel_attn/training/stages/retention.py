"""Learned retention for softmax layers with slots (kernels/retention.py): only the retention gates train. Two
objectives (``objective``):

``kl`` (TRIM-KV, Bui et al. 2025, arXiv 2512.03324): the model runs the soft form, every key a query could only
reach through the slots weighed by β_j^(t - p_j) inside the softmax, on

    L = τ² · mean_t KL(p_teacher,t ‖ p_student,t)  +  capacity_weight · mean_layers mean_t |E_t - min(C, n_t)| / C

The teacher is the same model with its full softmax attention, computed in the same step; E_t is the sum of
β_j^(t - p_j) over the n_t keys a query could only reach through the slots (the soft cache's expected size).

``attention`` (after Locret, Huang et al. 2024, arXiv 2410.01805, whose retaining heads learn each key's future
attention): one forward of the full-softmax model, no backward through it; per layer and KV head the keys the
later queries read most once they have left the window (the C highest of :func:`future_attention` in the block;
with ``read_distance`` D > W only the reads of queries at least D positions later count; with ``fact_labels`` the
stage states recall facts in every block (:func:`~hf_kernel_attn.training.recall_data.recall_rows`, the
data section's ``recall_max_facts`` and ``recall_style``) and their tokens are positives first, the keys read most
fill the rest of the C)
are the positives of a binary cross-entropy on the gate's logit z_j (ln β_j = ln σ(z_j)), weighed so that the
C positives count as much as the rest. The gate sees the original model's keys and values.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from ...integration.transfer import attention_probe, softmax_teacher
from ...kernels import is_softmax
from ...kernels.retention import capacity_terms, future_attention, sink_flags
from ...kernels.softmax import SoftmaxKernel
from ..losses import distillation_loss
from ..recall_data import recall_rows
from ..tasks import TASK_TYPES
from .base import TrainingStage, Trains, register_stage

OBJECTIVES = ("kl", "attention")


def _has_slots(config: dict[str, Any]) -> bool:
    """Whether some layer of the configured model runs softmax with slots."""
    if is_softmax(str(config.get("kernel"))) and (config.get("kernel_params") or {}).get("slots"):
        return True
    layers = config.get("layers")
    return isinstance(layers, dict) and "slots" in repr(layers)


@register_stage
class RetentionStage(TrainingStage):
    name = "retention"
    order = 4
    defaults = {"lr": 1e-2, "objective": "kl", "capacity_weight": 1.0, "temperature": 1.0, "max_grad_norm": 1.0,
                "read_distance": 0, "fact_labels": False}

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        if stage["objective"] not in OBJECTIVES:
            return f"stages.retention.objective must be one of {list(OBJECTIVES)}, got {stage['objective']!r}"
        for key in ("capacity_weight", "temperature"):
            x = stage[key]
            if not (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0):
                return f"stages.retention.{key} must be a number >= 0, got {x!r}"
        x = stage["read_distance"]
        if not (isinstance(x, int) and not isinstance(x, bool) and x >= 0):
            return f"stages.retention.read_distance must be an integer >= 0, got {x!r}"
        if not isinstance(stage["fact_labels"], bool):
            return f"stages.retention.fact_labels must be true or false, got {stage['fact_labels']!r}"
        if stage["fact_labels"] and stage["objective"] != "attention":
            return "stages.retention.fact_labels labels the keys of the attention objective: set objective: attention"
        if not stage["temperature"]:
            return "stages.retention.temperature must be > 0"
        if stage["steps"] and not _has_slots(config):
            return ("stages.retention trains the retention gates of softmax layers with slots, but the config gives "
                    "none: set kernel: softmax with kernel_params {window: W, slots: C, ...} (or slots in a layer's "
                    "options)")
        decay = (config.get("kernel_params") or {}).get("retention_decay", True)
        if stage["steps"] and stage["objective"] == "attention" and decay is not False:
            return ("stages.retention with objective attention trains a keep score that does not age (a key's "
                    "future attention), but the slots rank keys by (t - p) ln β: set kernel_params.retention_decay: "
                    "false, or use objective kl (which trains the aged score)")
        if stage["steps"] and not TASK_TYPES[config["task"]].language_model:
            return f"stages.retention distils next-token distributions: it needs task causal_lm, got {config['task']!r}"
        return None

    def trains(self) -> Trains:
        return Trains.RETENTION

    def _full_softmax(self, batch: dict[str, Any], probe=None) -> torch.Tensor:
        t = self.context
        was_training = t.model.training
        t.model.eval()
        try:
            with torch.no_grad(), softmax_teacher():
                if probe is None:
                    return t.model(**self.task.inputs(batch), use_cache=False).logits
                with attention_probe(probe):
                    return t.model(**self.task.inputs(batch), use_cache=False).logits
        finally:
            t.model.train(was_training)

    def _gated_layers(self) -> dict[int, SoftmaxKernel]:
        found = {m.shape.layer_idx: m for m in self.context.model.modules()
                 if isinstance(m, SoftmaxKernel) and m.slots > 0}
        if not found:
            raise ValueError("stages.retention trains retention gates, but no layer runs softmax with slots; give the "
                             "model kernel softmax with window, sinks and slots (kernel_params: {slots: C, ...})")
        return found

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        if self.cfg["objective"] == "attention":
            return self._attention_loss(batch)
        self._gated_layers()
        teacher = self._full_softmax(batch)
        with capacity_terms() as terms:
            out = self.context.student()(**self.task.inputs(batch), use_cache=False)
        loss = distillation_loss(out.logits, teacher, temperature=self.cfg["temperature"])
        return loss + self.cfg["capacity_weight"] * torch.stack(terms).mean()

    def _with_facts(self, batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        """``batch`` with recall facts stated in each row (drawn from the row's first tokens and the seed, so a
        resumed run sees the same) and where they were stated, ``[B, M]``."""
        data, ids = self.context.config["data"], batch["input_ids"]

        def encode(text: str) -> list[int]:
            return self.context.tokenizer(text, add_special_tokens=False)["input_ids"]

        rngs = [random.Random(hash((self.context.config["seed"], *row[:16]))) for row in ids.tolist()]
        new, spans = recall_rows(ids, encode, rngs, data["recall_max_facts"], data["recall_style"])
        stated = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        for r, row in enumerate(spans):
            for start, end, _, _ in row:
                stated[r, start:end] = True
        return {**batch, **{key: new for key in ("input_ids", "labels") if key in batch}}, stated

    def _attention_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        layers = self._gated_layers()
        seen: list[tuple] = []
        stated = None
        if self.cfg["fact_labels"]:
            batch, stated = self._with_facts(batch)

        def probe(layer, q, k, key_mask, causal, scaling, value=None):
            if layer in layers:
                seen.append((layers[layer], q, k, value, key_mask, scaling))

        self._full_softmax(batch, probe)
        losses = []
        for kernel, q, k, v, key_mask, scaling in seen:
            budget = kernel.options.budget()
            scale = q.shape[-1] ** -0.5 if scaling is None else scaling
            distance = max(budget.window, self.cfg["read_distance"])
            target = future_attention(q, k, key_mask, window=distance, scale=scale)
            m = k.shape[-2]
            real = torch.ones(k.shape[0], m, dtype=torch.bool, device=k.device) if key_mask is None else key_mask.bool()
            leaves = torch.arange(m, device=k.device) <= m - 1 - distance  # keys some query reads that far on
            eligible = (real & ~sink_flags(real, budget.sinks) & leaves)[:, None, :].expand_as(target)
            count = int(eligible[0, 0].sum())
            if count <= budget.slots:
                continue  # every eligible key fits in the slots: nothing to rank
            ranking = target.masked_fill(~eligible, -1.0)
            if stated is not None:  # the stated facts first (a softmax weight is at most 1)
                ranking = ranking.masked_fill(stated[:, None, :] & eligible, 2.0)
            ranked = ranking.topk(budget.slots, dim=-1).indices
            labels = torch.zeros_like(target).scatter_(-1, ranked, 1.0)
            z = kernel.retention_gate.logits(k, v)
            weight = torch.where(labels > 0, (count - budget.slots) / budget.slots, 1.0) * eligible
            losses.append((F.binary_cross_entropy_with_logits(z, labels, reduction="none") * weight).sum()
                          / weight.sum())
        if not losses:
            raise ValueError("stages.retention (objective attention): every block is shorter than window + slots, "
                             "so no key has to be ranked; raise data.seq_len")
        return torch.stack(losses).mean()
