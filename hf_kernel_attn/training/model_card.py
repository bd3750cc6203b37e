"""The model card of a converted checkpoint (``final/README.md``): Hub metadata (``base_model``,
``library_name``, ``tags``, ``datasets``, ``model-index``) readable with ``huggingface_hub.ModelCard``, then the
kernel, the recipe and budget, and the held-out scores the run measured."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..evaluation.tasks import EVAL_TASKS, EvalTask
from .config import configured_stages
from .tasks import TASK_TYPES

CARD_FILE = "README.md"
_METRICS = {"val_perplexity": "perplexity", "val_loss": "loss", "val_spearman": "spearmanr", "val_accuracy": "accuracy",
            "val_f1": "f1", "val_matthews_correlation": "matthews_correlation", "val_pearson": "pearsonr"}


def _hub_id(value: Any) -> str | None:
    """``value`` when it looks like a Hub id (``owner/name`` that is not a local path), else None."""
    if not isinstance(value, str) or value.count("/") != 1 or os.path.exists(value) or value.startswith((".", "/")):
        return None
    return value


def card_metadata(config: dict[str, Any], kernel_attention: dict[str, Any] | None,
                  scores: dict[str, float]) -> Any:
    """``huggingface_hub.ModelCardData`` of a converted model; ``scores`` are the final held-out scores."""
    from huggingface_hub import EvalResult, ModelCardData

    kernel = config["kernel"]
    task = TASK_TYPES[config["task"]]
    base = config.get("base_model_id") or _hub_id(config["model"])
    train = config["data"]["train"]
    datasets = [train] if isinstance(train, str) and _hub_id(train) else None
    tags = ["hf-kernel-attn", kernel]
    params = (kernel_attention or {}).get("params") or {}
    if params.get("window"):
        tags.append("sliding-window-hybrid")
    results = [
        EvalResult(task_type=task.hub_task, dataset_type="held-out", dataset_name=task.held_out_name,
                   metric_type=_METRICS.get(name, name.removeprefix("val_")),
                   metric_value=round(float(value), 4), dataset_split="validation")
        for name, value in scores.items()
    ]
    name = f"{Path(config['output_dir']).name}"
    return ModelCardData(base_model=base, library_name="transformers", tags=tags, datasets=datasets,
                         model_name=name, eval_results=results or None,
                         pipeline_tag=task.pipeline_tag)


def render_card(config: dict[str, Any], kernel_attention: dict[str, Any] | None, scores: dict[str, float],
                state: dict[str, Any]) -> str:
    """The whole README.md: metadata block and a short description of what runs and how it was made."""
    data = card_metadata(config, kernel_attention, scores)
    kernel = config["kernel"]
    kattn = kernel_attention or {"kernel": kernel, "params": config["kernel_params"]}
    stage_lines = []
    for stage in configured_stages(config):
        cfg = config["stages"][stage]
        if cfg["steps"]:
            extra = {k: cfg[k] for k in ("temperature", "ce_weight", "train", "r", "alpha") if k in cfg}
            budget = f", at most {cfg['max_minutes']} {config['budget_clock']}-minutes" if cfg["max_minutes"] else ""
            stage_lines.append(f"- `{stage}`: {cfg['steps']} steps, lr {cfg['lr']}{budget}"
                               + (f", {json.dumps(extra)}" if extra else ""))
    train = config["data"]["train"]
    files = [train] if isinstance(train, str) else [Path(f).name for f in train]
    score_lines = [f"- {k}: {v:.4g}" for k, v in scores.items()] or ["- (no validation)"]
    body = f"""
# {data.model_name}

A {config['task'].replace('_', ' ')} model converted with [hf_kernel_attn](https://pypi.org/project/hf-kernel-attn/):
its softmax attention runs the `{kernel}` kernel.

## Kernel

```json
{json.dumps(kattn, indent=2, sort_keys=True)}
```

Load it with `transformers` (the plugin must be installed, or pass `trust_remote_code=True`):

```python
import hf_kernel_attn, transformers
model = transformers.{TASK_TYPES[config['task']].auto_class}.from_pretrained("PATH")
```

## Recipe

Base model: `{data.base_model or config['model']}`; training text: {', '.join(f'`{f}`' for f in files)}
(the held-out end of each file is the validation text); sequence length {config['data']['seq_len']}, batch
{config['data']['batch_size']} × {config['data']['grad_accum']} accumulation × processes; seed {config['seed']}.

{chr(10).join(stage_lines)}

Trained on {state.get('tokens', 0):,} tokens in {state.get('cpu_seconds', 0.0) / 60:.1f} CPU-minutes
({state.get('seconds', 0.0) / 60:.1f} minutes wall-clock).

## Held-out scores (end of training)

{chr(10).join(score_lines)}
"""
    return "---\n" + data.to_yaml() + "\n---\n" + body


def write_card(folder: Path, config: dict[str, Any], kernel_attention: dict[str, Any] | None,
               scores: dict[str, float], state: dict[str, Any]) -> Path:
    path = Path(folder) / CARD_FILE
    path.write_text(render_card(config, kernel_attention, scores, state))
    return path


def add_eval_results(folder: str | os.PathLike, records: list[dict[str, Any]], *, limit: int | None = None) -> Path:
    """Add ``hf-kernel-attn eval`` records to the ``model-index`` of the card in ``folder`` (``--update-card``);
    a result for the same task, metric, split and slice replaces the old one. ValueError when there is no card."""
    from huggingface_hub import EvalResult, ModelCard

    path = Path(folder) / CARD_FILE
    if not path.is_file():
        raise ValueError(f"--update-card: no model card at {str(path)!r} (checkpoints written by "
                         "`hf-kernel-attn finetune` have one); evaluate without --update-card")
    card = ModelCard.load(path)
    results = list(card.data.eval_results or [])
    for r in records:
        where = [f"first {limit}"] if limit else []
        if r.get("length") is not None:
            where.append(f"{r['length']} tokens")
        if r.get("depth") is not None:
            where.append(f"depth {r['depth']}%")
        name = r["task"] + (f" ({', '.join(where)})" if where else "")
        task = EVAL_TASKS[r["task"]] if r["task"] in EVAL_TASKS else None
        new = EvalResult(task_type=task.hub_task_type if task is not None else EvalTask.hub_task_type,
                         dataset_type=r["task"], dataset_name=name, metric_type=r["metric"],
                         metric_value=round(float(r["value"]), 6), dataset_split=r.get("split"))
        results = [old for old in results if (old.dataset_name, old.metric_type, old.dataset_split)
                   != (new.dataset_name, new.metric_type, new.dataset_split)] + [new]
    card.data.eval_results = results
    if card.data.model_name is None:
        card.data.model_name = Path(folder).name
    card.save(path)
    return path
