"""``hf-kernel-attn eval``: load (or patch) a model once per head type, run the tasks, write one JSON
line per (model, kernel, layers, task, split, metric)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..model_paths import check_local_path, load_errors, locate_model
from .long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from .tasks import (
    EMBEDDING_TASKS,
    GLUE_EVAL_TASKS,
    LM_EVAL_TASKS,
    LONG_CONTEXT_TASKS,
    NATURAL_TEXT_TASKS,
    TEXT_TASKS,
    check_data_files,
    check_split,
    check_tasks,
    glue_metrics,
    model_kind,
    read_text_task,
)

RECORD_KEYS = ("model", "kernel", "params", "layers", "task", "split", "metric", "value", "stderr", "n", "seconds")
LONG_CONTEXT_KEYS = ("length", "depth")  # added to the records of long-context tasks
COST_KEYS = ("cache_bytes", "decode_ms_per_token", "decode_batch")  # what a recall cell cost (long_context.runner)
_CLASSES = {"causal_lm": "AutoModelForCausalLM", "sequence_classification": "AutoModelForSequenceClassification",
            "embedding": "AutoModel"}


@dataclasses.dataclass
class ModelSpec:
    """A saved model (its own kernel) or one patched on the fly with ``kernel``/``layers``/``params``."""

    model: str
    gguf_file: str | None = None
    kernel: str | None = None
    layers: Any = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def load(self, kind: str):
        """The model (``pkg:``, folder or hub id; see :mod:`hf_kernel_attn.model_paths`) and its tokenizer; a
        one-line ModelLoadError when it cannot be loaded."""
        import transformers
        from transformers import AutoTokenizer

        import hf_kernel_attn

        if self.kernel is None and (self.layers is not None or self.params):
            raise ValueError("--layers/--param need --kernel (without it the model runs its saved kernel)")
        path = locate_model(self.model, self.gguf_file)
        kwargs = {"gguf_file": self.gguf_file} if self.gguf_file else {}
        cls = getattr(transformers, _CLASSES[kind])
        with load_errors(self.model, self.gguf_file):
            if self.kernel is not None:
                model = hf_kernel_attn.from_pretrained(path, kernel=self.kernel, layers=self.layers,
                                                       model_class=cls, kernel_params=self.params, **kwargs)
            else:
                model = cls.from_pretrained(path, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model.eval(), tokenizer

    def kernel_name(self, model) -> str:
        import hf_kernel_attn

        cfg = hf_kernel_attn.kernel_config(model)
        return cfg.kernel if cfg else "softmax"

    def params_repr(self, model) -> dict[str, Any]:
        import hf_kernel_attn

        cfg = hf_kernel_attn.kernel_config(model)
        return dict(cfg.params) if cfg else {}

    def layers_repr(self, model) -> Any:
        import hf_kernel_attn

        cfg = hf_kernel_attn.kernel_config(model)
        return cfg.to_dict().get("layers") or None if cfg else None


def check_model_path(model: str) -> None:
    """Raise FileNotFoundError for a local model folder that does not exist. A hub id is ``name`` or
    ``namespace/name``; anything with more path parts, or starting with ``.``, ``/`` or ``~``, is a folder
    (otherwise transformers reports a missing folder as a malformed repo id). See
    :func:`hf_kernel_attn.model_paths.locate_model` for the full check."""
    check_local_path(model)


def _record(spec: ModelSpec, model, task: str, split: str, metric: str, value: float, stderr: float | None,
            n: int, seconds: float) -> dict[str, Any]:
    return {"model": spec.model, "kernel": spec.kernel_name(model), "params": spec.params_repr(model),
            "layers": spec.layers_repr(model), "task": task, "split": split, "metric": metric, "value": value,
            "stderr": stderr, "n": n, "seconds": round(seconds, 2)}


def _perplexity_task(spec, model, tok, task, split, data_dir, limit, batch_size, context, stride):
    from .perplexity import strided_perplexity

    start = time.perf_counter()
    text = read_text_task(task, split, data_dir)
    res = strided_perplexity(model, tok, text, context=context, stride=stride, limit=limit, batch_size=batch_size)
    secs = time.perf_counter() - start
    return [_record(spec, model, task, split, "perplexity", res["perplexity"], None, res["tokens"], secs),
            _record(spec, model, task, split, "bits_per_byte", res["bits_per_byte"], None, res["tokens"], secs)]


@torch.no_grad()
def _glue_task(spec, model, tok, task, split, data_dir, limit, batch_size):
    from ..data import load_glue

    start = time.perf_counter()
    rows = load_glue(task, split, data_dir)[: limit or None]
    from tqdm.auto import tqdm

    preds, gold = [], []
    for s in tqdm(range(0, len(rows), batch_size), desc=task, leave=False):
        part = rows[s:s + batch_size]
        pair = [r.text_b for r in part] if part[0].text_b is not None else None
        enc = tok([r.text_a for r in part], pair, padding=True, truncation=True, max_length=512, return_tensors="pt")
        logits = model(**enc).logits
        preds += (logits[:, 0] if logits.shape[-1] == 1 else logits.argmax(-1)).tolist()
        gold += [r.label for r in part]
    secs = time.perf_counter() - start
    return [_record(spec, model, task, split, metric, value, se, len(rows), secs)
            for metric, (value, se) in glue_metrics(task, preds, gold).items()]


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


def _embedding_task(spec, model, tok, task, split, data_dir, limit, batch_size):
    from ..data import load_glue
    from .metrics import load_metric

    start = time.perf_counter()
    rows = load_glue("stsb", split, data_dir)[: limit or None]
    a = embed(model, tok, [r.text_a for r in rows], batch_size)
    b = embed(model, tok, [r.text_b for r in rows], batch_size)
    sims = torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
    spear = load_metric("spearmanr").compute(predictions=sims, references=[r.label for r in rows])["spearmanr"]
    secs = time.perf_counter() - start
    return [_record(spec, model, task, split, "spearman", 100 * spear, None, len(rows), secs)]


def _long_context_task(spec, model, tok, task, split, data_dir, lengths, depths, samples, seed):
    from .long_context.runner import read_filler_text, run_long_context

    text = read_filler_text(data_dir, split) if task in NATURAL_TEXT_TASKS else None

    def progress(task, metric, length, depth, scores, secs, cost):
        ms = cost.get("decode_ms_per_token")
        paid = f"cache {cost['cache_bytes'] / 2**20:.1f} MiB" + ("" if ms is None else f", {ms:.0f} ms/token")
        print(f"{task} {metric} length {length} depth {depth}: "
              + ", ".join(f"{k} {100 * sum(v) / len(v):.0f}%" for k, v in scores.items()) + f" ({paid}; {secs:.1f} s)",
              flush=True)

    cells = run_long_context(model, tok, task, lengths=lengths, depths=depths, samples=samples, seed=seed, text=text,
                             progress=progress)
    out = []
    for c in cells:
        rec = _record(spec, model, task, split, c["metric"], c["value"], c["stderr"], c["n"], c["seconds"])
        rec.update(length=c["length"], depth=c["depth"], seed=seed)
        rec.update({key: c[key] for key in ("position_start", *COST_KEYS) if key in c})
        out.append(rec)
    return out


def check_local_data(tasks: list[str], split: str, data_dir: str | os.PathLike) -> None:
    """Before any model loads: every task's local files exist (the error lists the expected files) and
    parse (binary, non-UTF-8 or empty files and missing columns raise, naming the file)."""
    check_data_files(tasks, split, data_dir)
    for task in tasks:
        if task in TEXT_TASKS:
            read_text_task(task, split, data_dir)
        elif task in LONG_CONTEXT_TASKS:
            if task in NATURAL_TEXT_TASKS:
                read_text_task("wikitext2", split, data_dir)
        elif task in LM_EVAL_TASKS:
            from .lm_eval_tasks import local_rows

            local_rows(task, data_dir, split)
        else:
            from ..data import load_glue

            rows = load_glue("stsb" if task in EMBEDDING_TASKS else task, split, data_dir)
            if not rows:
                raise ValueError(f"{task} --split {split}: the local file holds no examples")


def run_eval(spec: ModelSpec, tasks: list[str], *, data_dir: str | os.PathLike | None = None,
             split: str = "validation", limit: int | None = None, batch_size: int = 1, context: int = 1024,
             stride: int | None = None, output: str | os.PathLike | None = None,
             lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
             depths: list[float] | tuple[float, ...] = DEFAULT_DEPTHS, samples: int = DEFAULT_SAMPLES,
             seed: int = 0, plot_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Run ``tasks`` on the model of ``spec``; append each record to ``output`` (JSONL) as it finishes.
    Long-context tasks run every (length, depth) cell of ``lengths`` × ``depths`` with ``samples`` prompts,
    deterministic for ``seed``; ``plot_dir`` gets their heat maps and loss curves."""
    check_tasks(tasks)
    if any(t in LONG_CONTEXT_TASKS for t in tasks):
        from .long_context.runner import check_long_context_args

        check_long_context_args(list(lengths), list(depths), samples, seed)
    check_split(split)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {str(data_dir)!r} is not a folder")
    if data_dir is not None:
        check_local_data(tasks, split, data_dir)
    records: list[dict[str, Any]] = []
    loaded: dict[str, Any] = {}
    for task in tasks:
        kind = model_kind(task)
        if kind not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[kind] = spec.load(kind)
        model, tok = loaded[kind]
        if task in TEXT_TASKS:
            new = _perplexity_task(spec, model, tok, task, split, data_dir, limit, batch_size, context, stride)
        elif task in GLUE_EVAL_TASKS:
            new = _glue_task(spec, model, tok, task, split, data_dir, limit, max(batch_size, 16))
        elif task in EMBEDDING_TASKS:
            new = _embedding_task(spec, model, tok, task, split, data_dir, limit, max(batch_size, 32))
        elif task in LONG_CONTEXT_TASKS:
            new = _long_context_task(spec, model, tok, task, split, data_dir, lengths, depths, samples, seed)
        else:
            assert task in LM_EVAL_TASKS
            from .lm_eval_tasks import run_lm_eval_tasks

            new = [_record(spec, model, *r) for r in run_lm_eval_tasks(model, tok, [task], data_dir=data_dir,
                                                                        split=split, limit=limit,
                                                                        batch_size=batch_size)]
        records += new
        if output:
            with open(output, "a") as f:
                for r in new:
                    f.write(json.dumps(r) + "\n")
    if plot_dir is not None and any(r["task"] in LONG_CONTEXT_TASKS for r in records):
        from .long_context.plots import plot_long_context

        plot_long_context(records, plot_dir)
    return records


def summary_table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'task':16s} {'split':10s} {'kernel':10s} {'metric':22s} {'length':>6s} {'depth':>5s} {'value':>10s} "
             f"{'stderr':>8s} {'n':>7s}"]
    for r in records:
        se = "" if r["stderr"] is None else f"{r['stderr']:.4g}"
        length = "" if r.get("length") is None else str(r["length"])
        depth = "" if r.get("depth") is None else f"{r['depth']:g}"
        lines.append(f"{r['task']:16s} {r['split']:10s} {r['kernel']:10s} {r['metric']:22s} {length:>6s} {depth:>5s} "
                     f"{r['value']:10.4f} {se:>8s} {r['n']:7d}")
    return "\n".join(lines)
