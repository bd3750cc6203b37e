"""Association benchmarks trained from scratch: multi-query associative recall and ListOps-style
nested operations, generated on the fly, with a tiny Llama per kernel.

The sequences and their rules (Zoology's MQAR, Long Range Arena's ListOps) are in :mod:`.synthetic_tasks`.

The model (``LlamaForCausalLM`` from the setting's YAML) is patched with ``hf_kernel_attn.patch(model,
kernel=K)`` — softmax too, so every kernel runs through the same path — and trained with AdamW on the
answer positions only. Accuracy is measured on a fixed held-out set drawn from the setting's eval seed;
training examples that coincide with a held-out example are redrawn. Results are leaderboard records
(the ``results.jsonl`` schema of ``leaderboard/runner.py``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import hf_kernel_attn

from ..fileio import append_jsonl_atomic, read_jsonl
from ..kernels import KERNELS, is_softmax
from .synthetic_tasks import IGNORE, random_listops, random_mqar

TASKS = ("mqar", "listops")
TRAIN_KERNELS = ("softmax", "gaussian", "cosine", "elu", "hedgehog", "performer")
EVAL_SEED_FLOOR = 1_000_000  # training seeds are below this; held-out sets are drawn from seeds above it

# ------------------------------------------------------------------------------------------ settings

_SECTIONS = {
    "task": None,
    "data": None,
    "model": {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"},
    "train": {"steps", "batch_size", "lr", "weight_decay", "warmup"},
    "eval": {"num_examples", "seed"},
    "kernel_params": None,
}
_DATA_KEYS = {"mqar": {"seq_len", "num_pairs", "vocab_size"},
              "listops": {"min_length", "max_length", "max_depth", "max_args"}}


def settings_dir() -> Path:
    """``configs/synthetic`` of the source tree (the package is installed editable), else of the cwd."""
    here = Path(__file__).resolve().parents[2] / "configs" / "synthetic"
    return here if here.is_dir() else Path("configs/synthetic")


def available_settings(task: str | None = None) -> dict[str, Path]:
    out = {}
    for path in sorted(settings_dir().glob("*.yaml")):
        if task is None or _read_yaml(path).get("task") == task:
            out[path.stem] = path
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


@dataclass
class Setting:
    name: str
    task: str
    data: dict[str, int]
    model: dict[str, int]
    train: dict[str, float]
    eval: dict[str, int]
    kernel_params: dict[str, dict[str, Any]]
    path: str = ""

    @property
    def seq_len(self) -> int:
        return self.data["seq_len"] if self.task == "mqar" else self.data["max_length"] + 1

    @property
    def vocab_size(self) -> int:
        return self.data["vocab_size"] if self.task == "mqar" else 32

    def sampler(self) -> Callable[[np.random.Generator], tuple[np.ndarray, np.ndarray]]:
        d = self.data
        if self.task == "mqar":
            return lambda rng: random_mqar(rng, d["seq_len"], d["num_pairs"], d["vocab_size"])
        return lambda rng: random_listops(rng, d["min_length"], d["max_length"], d["max_depth"], d["max_args"])

    def chance(self) -> float:
        """Accuracy of guessing uniformly among the possible answers."""
        return 1 / (self.vocab_size - self.vocab_size // 2) if self.task == "mqar" else 0.1


def load_setting(task: str, setting: str | os.PathLike | None = None) -> Setting:
    """A setting by name (``configs/synthetic/<name>.yaml``) or path; ValueError naming the valid choices."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; valid tasks: {list(TASKS)}")
    valid = available_settings(task)
    if setting is None:
        if not valid:
            raise ValueError(f"no settings for task {task!r} in {settings_dir()}")
        setting = task if task in valid else next(iter(valid))
    path = Path(setting)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        if str(setting) not in valid:
            raise ValueError(f"unknown setting {str(setting)!r} for task {task!r}; valid settings: {sorted(valid)} "
                             "(or a path to a YAML file)")
        path = valid[str(setting)]
    cfg = _read_yaml(path)
    unknown = sorted(set(cfg) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; valid: {sorted(_SECTIONS)}")
    if cfg.get("task") != task:
        raise ValueError(f"{path} is a {cfg.get('task')!r} setting, not {task!r}")
    for section, keys in [("data", _DATA_KEYS[task]), *((s, k) for s, k in _SECTIONS.items() if k)]:
        got = set(cfg.get(section) or {})
        if got != keys:
            raise ValueError(f"{path}: section {section!r} needs exactly {sorted(keys)}, got {sorted(got)}")
    return Setting(path.stem, task, cfg["data"], cfg["model"], cfg["train"], cfg["eval"],
                   cfg.get("kernel_params") or {}, str(path))


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < EVAL_SEED_FLOOR:
        raise ValueError(f"seed must be an integer in [0, {EVAL_SEED_FLOOR}) (held-out sets use seeds above), "
                         f"got {seed!r}")
    return seed


# -------------------------------------------------------------------------------------------- data


def heldout_set(setting: Setting, num_examples: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The fixed held-out set: ``eval.num_examples`` examples from ``eval.seed`` (distinct from any training
    seed); duplicates inside the set are dropped."""
    rng = np.random.default_rng(setting.eval["seed"])
    sample = setting.sampler()
    n = num_examples or setting.eval["num_examples"]
    seen: set[bytes] = set()
    ids, targets = [], []
    for _ in range(50 * n):
        x, y = sample(rng)
        if x.tobytes() in seen:
            continue
        seen.add(x.tobytes())
        ids.append(x)
        targets.append(y)
        if len(ids) == n:
            break
    return np.stack(ids), np.stack(targets)


def training_batches(setting: Setting, seed: int, batch_size: int, exclude: set[bytes]):
    """Endless batches from ``seed``; an example equal to a held-out one (``exclude``) is redrawn."""
    rng = np.random.default_rng(check_seed(seed))
    sample = setting.sampler()
    while True:
        ids, targets = [], []
        while len(ids) < batch_size:
            x, y = sample(rng)
            if x.tobytes() not in exclude:
                ids.append(x)
                targets.append(y)
        yield np.stack(ids), np.stack(targets)


# ------------------------------------------------------------------------------------------- model


def build_model(setting: Setting, kernel: str, seed: int):
    """A small ``LlamaForCausalLM`` from the setting, patched with ``kernel`` (softmax included)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = setting.model
    config = LlamaConfig(
        vocab_size=setting.vocab_size, hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_attention_heads"], max_position_embeddings=setting.seq_len,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    params = {} if is_softmax(kernel) else setting.kernel_params.get(kernel, {})
    hf_kernel_attn.patch(model, kernel=kernel, **params)
    return model


def _answer_logits(model, ids, targets):
    hidden = model.model(input_ids=ids).last_hidden_state
    mask = targets != IGNORE
    return model.lm_head(hidden[mask]), targets[mask]


def evaluate(model, ids: np.ndarray, targets: np.ndarray, batch_size: int = 128) -> tuple[int, int]:
    """(correct, scored) answers of the held-out set."""
    import torch

    correct = total = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(ids), batch_size):
            logits, y = _answer_logits(model, torch.from_numpy(ids[i:i + batch_size]),
                                       torch.from_numpy(targets[i:i + batch_size]))
            correct += int((logits.argmax(-1) == y).sum())
            total += int(y.numel())
    return correct, total


def run_synthetic(task: str, kernel: str, seed: int, setting: str | None = None, steps: int | None = None,
                  threads: int | None = 1, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Train the setting's tiny Llama with ``kernel`` from scratch and return its leaderboard record."""
    import torch
    import torch.nn.functional as F

    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; available kernels: {sorted(KERNELS)}")
    check_seed(seed)
    st = load_setting(task, setting)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if threads:
        torch.set_num_threads(threads)
    t = st.train
    steps = steps or int(t["steps"])
    wall0, cpu0 = time.perf_counter(), time.process_time()
    eval_ids, eval_targets = heldout_set(st)
    exclude = {x.tobytes() for x in eval_ids}
    model = build_model(st, kernel, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"], betas=(0.9, 0.98))
    warmup = min(int(t["warmup"]), steps)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to 10 %
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    batches = training_batches(st, seed, int(t["batch_size"]), exclude)
    model.train()
    losses = []
    for step in range(steps):
        ids, targets = next(batches)
        for group in opt.param_groups:
            group["lr"] = t["lr"] * lr_at(step)
        logits, y = _answer_logits(model, torch.from_numpy(ids), torch.from_numpy(targets))
        loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log and (step + 1) % max(1, steps // 6) == 0:
            log(f"{st.name} {kernel} seed {seed}: step {step + 1}/{steps} loss {np.mean(losses[-20:]):.3f}")
    correct, total = evaluate(model, eval_ids, eval_targets)
    acc = correct / total
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    record = {
        "model_name": f"tiny-llama seed {seed}", "kernel_row": kernel,
        "model": f"tiny-llama:configs/synthetic/{st.name}.yaml", "kernel": kernel, "layers": None,
        "task": st.name, "split": "heldout", "metric": "accuracy", "value": 100 * acc,
        "stderr": 100 * math.sqrt(acc * (1 - acc) / total), "n": total, "seconds": round(wall, 2),
        "seed": seed, "task_family": task, "steps": steps, "cpu_seconds": round(cpu, 2),
        "threads": torch.get_num_threads(), "final_train_loss": round(float(np.mean(losses[-20:])), 4),
        "chance": 100 * st.chance(),
        "context_baseline": 100 / st.data["num_pairs"] if task == "mqar" else None,
    }
    if log:
        log(f"{st.name} {kernel} seed {seed}: accuracy {100 * acc:.2f} % on {total} held-out answers "
            f"({cpu:.1f} CPU-s, {wall:.1f} s)")
    return record


def run_many(task: str, kernels: list[str], seeds: list[int], settings: list[str] | None = None,
             output: str | os.PathLike | None = None, steps: int | None = None, threads: int | None = 1,
             log: Callable[[str], None] | None = print) -> list[dict[str, Any]]:
    """Every (setting, kernel, seed); with ``output`` (a results.jsonl) finished runs are skipped and each new
    record is appended atomically as soon as its run ends, so a killed sweep resumes where it stopped."""
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; available kernels: {sorted(KERNELS)}")
    for s in seeds:
        check_seed(s)
    names = settings or list(available_settings(task)) or [None]
    resolved = [load_setting(task, s) for s in names]  # validate every setting before any run
    path = Path(output) if output else None
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["task"], r["kernel"], r.get("seed")) for r in read_jsonl(path)} if path else set()
    records = []
    for st in resolved:
        for kernel in kernels:
            for seed in seeds:
                if (st.name, kernel, seed) in done and steps is None:
                    if log:
                        log(f"{st.name} {kernel} seed {seed}: already in {path}, skipped")
                    continue
                rec = run_synthetic(task, kernel, seed, st.path, steps=steps, threads=threads, log=log)
                if path:
                    append_jsonl_atomic(path, [rec])
                records.append(rec)
    return records
