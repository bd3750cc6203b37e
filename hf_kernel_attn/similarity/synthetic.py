"""Association benchmarks trained from scratch: multi-query associative recall and ListOps-style
nested operations, generated on the fly, with a tiny Llama per kernel.

* **MQAR** (Zoology, Arora et al. 2023; Based, Arora et al. ICML 2024): a sequence opens with P
  key-value pairs ``k1 v1 … kP vP``; then P queries, each a key drawn uniformly (with replacement) from
  the P keys, sit at random non-overlapping slots of the remaining positions, each followed by its value;
  other positions hold a filler token. The model is scored on predicting the value at each query position.
  Keys are drawn without replacement from ``[1, V/2)``, values with replacement from ``[V/2, V)``.
  (Zoology spaces the queries by a power law; here the slots are uniform. Queries are drawn with
  replacement: querying every key exactly once lets a model answer late queries by elimination — the
  one value not yet repeated — which a first probe of this runner learned instead of recall.)
* **ListOps** (Nangia & Bowman 2018; the generator rules of Long Range Arena, Tay et al. ICLR 2021):
  a tree whose nodes are digits 0–9 or ``[OP a1 … an ]`` with OP ∈ {MAX, MIN, MED, SM}, n ∈ [2, max_args];
  below max_depth a node is an operator with probability 1/4, else a digit; trees outside
  [min_length, max_length] tokens are redrawn. MED = ⌊median⌋ (LRA's ``int(np.median)``: the mean of the
  two middle values for an even count, truncated), SM = sum mod 10. The answer digit is predicted after
  a final ``=`` token.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import hf_kernel_attn

from ..fileio import append_jsonl_atomic, read_jsonl
from ..kernels import KERNELS, is_softmax

TASKS = ("mqar", "listops")
TRAIN_KERNELS = ("softmax", "gaussian", "cosine", "elu", "hedgehog", "performer")
EVAL_SEED_FLOOR = 1_000_000  # training seeds are below this; held-out sets are drawn from seeds above it
IGNORE = -100

# ---------------------------------------------------------------------------------------------- MQAR


def mqar_example(keys: Iterable[int], values: Iterable[int], queries: Iterable[int], positions: Iterable[int],
                 seq_len: int, filler: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One MQAR sequence: pairs at 0..2P-1, then key ``keys[queries[j]]`` at ``positions[j]`` followed by its
    value. Returns (input_ids, targets) with ``targets[positions[j]] = values[queries[j]]``, -100 elsewhere."""
    keys, values, queries, positions = list(keys), list(values), list(queries), list(positions)
    p = len(keys)
    if len(values) != p or len(set(keys)) != p or not all(0 <= j < p for j in queries) \
            or len(positions) != len(queries):
        raise ValueError("mqar_example needs P distinct keys, P values, query indices in range(P) and one "
                         "position per query")
    ids = np.full(seq_len, filler, dtype=np.int64)
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    ids[0:2 * p:2], ids[1:2 * p:2] = keys, values
    used: set[int] = set()
    for j, pos in zip(queries, positions, strict=True):
        if pos < 2 * p or pos + 1 >= seq_len or {pos, pos + 1} & used:
            raise ValueError(f"query position {pos} overlaps the pairs, another query or the end")
        used |= {pos, pos + 1}
        ids[pos], ids[pos + 1], targets[pos] = keys[j], values[j], values[j]
    return ids, targets


def random_mqar(rng: np.random.Generator, seq_len: int, num_pairs: int, vocab_size: int
                ) -> tuple[np.ndarray, np.ndarray]:
    half = vocab_size // 2
    slots = (seq_len - 2 * num_pairs) // 2
    if half - 1 < num_pairs or slots < num_pairs:
        raise ValueError(f"mqar: {num_pairs} pairs do not fit vocab_size {vocab_size} / seq_len {seq_len}")
    keys = rng.choice(np.arange(1, half), num_pairs, replace=False)
    values = rng.integers(half, vocab_size, num_pairs)
    queries = rng.integers(0, num_pairs, num_pairs)
    positions = 2 * num_pairs + 2 * np.sort(rng.choice(slots, num_pairs, replace=False))
    return mqar_example(keys, values, queries, positions, seq_len)


# ------------------------------------------------------------------------------------------- ListOps

LISTOPS_TOKENS = ["<pad>", *[str(d) for d in range(10)], "[MIN", "[MAX", "[MED", "[SM", "]", "="]
LISTOPS_ID = {t: i for i, t in enumerate(LISTOPS_TOKENS)}
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VALUE_P = 0.25  # LRA: below max_depth a node is an operator with probability VALUE_P


def apply_op(op: str, args: list[int]) -> int:
    """LRA's operator rules: MIN, MAX, MED = int(median) (even count: mean of the middle two, truncated),
    SM = sum mod 10."""
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        s = sorted(args)
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; valid: {list(OPERATORS)}")


def listops_value(tokens: list[str]) -> int:
    """Evaluate a ListOps token list such as ``"[MAX 2 9 [MIN 4 7 ] 0 ]".split()``."""
    stack: list[list] = [[None, []]]
    for tok in tokens:
        if tok in OPERATORS:
            stack.append([tok, []])
        elif tok == "]":
            op, args = stack.pop()
            if op is None or not args:
                raise ValueError(f"unbalanced ListOps expression {' '.join(tokens)!r}")
            stack[-1][1].append(apply_op(op, args))
        elif tok.isdigit() and len(tok) == 1:
            stack[-1][1].append(int(tok))
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if len(stack) != 1 or len(stack[0][1]) != 1:
        raise ValueError(f"ListOps expression {' '.join(tokens)!r} is not one balanced tree")
    return stack[0][1][0]


def random_tree(rng: np.random.Generator, depth: int, max_depth: int, max_args: int) -> list[str]:
    """Tokens of a random tree by LRA's rules (the root is at depth 1)."""
    if depth >= max_depth or rng.random() > VALUE_P:
        return [str(int(rng.integers(10)))]
    op = OPERATORS[int(rng.integers(len(OPERATORS)))]
    out = [op]
    for _ in range(int(rng.integers(2, max_args + 1))):
        out += random_tree(rng, depth + 1, max_depth, max_args)
    return out + ["]"]


def listops_example(tokens: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens =`` padded to ``seq_len``; the target (answer digit) sits at the ``=`` position."""
    if len(tokens) + 1 > seq_len:
        raise ValueError(f"ListOps expression of {len(tokens)} tokens does not fit seq_len {seq_len}")
    ids = np.zeros(seq_len, dtype=np.int64)
    ids[: len(tokens) + 1] = [LISTOPS_ID[t] for t in tokens] + [LISTOPS_ID["="]]
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    targets[len(tokens)] = LISTOPS_ID[str(listops_value(tokens))]
    return ids, targets


def random_listops(rng: np.random.Generator, min_length: int, max_length: int, max_depth: int, max_args: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    for _ in range(100_000):
        tokens = random_tree(rng, 1, max_depth, max_args)
        if min_length <= len(tokens) <= max_length:
            return listops_example(tokens, max_length + 1)
    raise ValueError(f"listops: no tree of {min_length}-{max_length} tokens at max_depth {max_depth}")


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
