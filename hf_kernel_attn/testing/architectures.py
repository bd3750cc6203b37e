"""Architecture coverage: tiny random models of many transformers architectures, each patched with a few kernels.

For every :class:`Architecture` in :data:`ARCHITECTURES` the harness builds a tiny random config with
``AutoConfig.for_model(model_type, **overrides)`` (:mod:`.tiny_configs`: hidden 32, 2 layers, 4 heads, 2 KV heads
where the config has them, vocab 128, 128 positions), builds the model with ``attn_implementation="sdpa"``
(``"eager"`` where the architecture refuses SDPA) under a fixed seed, runs it once as the reference, and then, for
each kernel, patches a deep copy with :func:`hf_kernel_attn.patch` and runs the same unpadded inputs. A cell is

* ``ok`` — the forward ran, the output is finite, every attached kernel was called, and (softmax only) the
  output equals the reference within :data:`SOFTMAX_ATOL`;
* ``refused`` — ``patch`` or the forward raised a ValueError / NotImplementedError from hf_kernel_attn itself
  (a deliberate refusal that names its reason);
* ``error`` — any other exception (a KeyError deep inside transformers, a shape error, ...);
* ``mismatch`` / ``non-finite`` / ``not run`` — it ran but softmax differs from the reference, the output has
  NaN/inf, or some attached kernel was never called (the model bypassed the AttentionInterface).

    from hf_kernel_attn.testing.architectures import run_all, markdown_table
    print(markdown_table(run_all()))
"""

from __future__ import annotations

import copy
import dataclasses
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import hf_kernel_attn
from hf_kernel_attn.integration.patching import attention_modules
from hf_kernel_attn.kernels import Kernel

from ..kernels import is_softmax
from .tiny_configs import VOCAB, tiny_config

KERNELS = ("softmax", "gaussian", "cosine", "elu", "hedgehog")
SOFTMAX_ATOL = 1e-5
BATCH, SEQ = 2, 12
SEED = 0

DECODER, ENCODER, SEQ2SEQ, VISION = "decoder", "encoder", "seq2seq", "vision"
_AUTO = {DECODER: "AutoModelForCausalLM", ENCODER: "AutoModel", SEQ2SEQ: "AutoModelForSeq2SeqLM", VISION: "AutoModel"}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One row of the coverage table: a model type, its tiny config's extra overrides, and how to run it."""

    name: str  # row label: the model type, or "model_type (variant)"
    model_type: str
    kind: str = DECODER
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # on top of TINY, applied verbatim
    auto_class: str | None = None  # default: by kind (_AUTO)

    def config(self) -> Any:
        return tiny_config(self.model_type, **self.overrides)

    def auto(self) -> str:
        return self.auto_class or _AUTO[self.kind]

    def inputs(self, config: Any) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(SEED)
        if self.kind == VISION:
            size = int(getattr(config, "image_size", 32))
            return {"pixel_values": torch.randn(BATCH, int(getattr(config, "num_channels", 3)), size, size,
                                                generator=g)}
        vocab = int(getattr(config, "vocab_size", VOCAB))
        ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.kind == SEQ2SEQ:
            dec = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
            out["decoder_input_ids"] = dec
        return out


def _arch(name: str, kind: str = DECODER, model_type: str | None = None, **overrides: Any) -> Architecture:
    return Architecture(name, model_type or name, kind, overrides)


NO_WINDOW = {"sliding_window": None}
ARCHITECTURES: list[Architecture] = [
    # decoders (AutoModelForCausalLM)
    _arch("llama"),
    _arch("mistral", **NO_WINDOW),  # Mistral-7B-v0.3 and later: full attention
    _arch("mistral (sliding_window=4)", model_type="mistral", sliding_window=4),
    _arch("mixtral"),
    _arch("ministral"),
    _arch("qwen2"),
    _arch("qwen2 (use_sliding_window)", model_type="qwen2", use_sliding_window=True, sliding_window=4,
          max_window_layers=1),
    _arch("qwen3"),
    _arch("qwen3_moe"),
    _arch("smollm3"),
    _arch("gemma"),
    _arch("gemma2"),
    _arch("gemma3_text", layer_types=["sliding_attention", "full_attention"]),
    _arch("cohere"),
    _arch("cohere2"),
    _arch("phi", partial_rotary_factor=0.5),
    _arch("phi3"),
    _arch("gpt2"),
    _arch("gpt_neox", rotary_pct=0.5),
    _arch("gpt_bigcode"),
    _arch("olmo"),
    _arch("olmo2"),
    _arch("olmo3"),
    _arch("stablelm"),
    _arch("starcoder2"),
    _arch("granite"),
    _arch("granitemoe"),
    _arch("glm"),
    _arch("glm4"),
    _arch("helium"),
    _arch("arcee"),
    _arch("nemotron"),
    _arch("persimmon"),
    _arch("exaone4"),
    _arch("opt", word_embed_proj_dim=32),
    _arch("biogpt"),
    _arch("xglm"),
    _arch("falcon"),
    _arch("gptj", rotary_dim=4),
    _arch("codegen", rotary_dim=4),
    _arch("gpt_neo", attention_types=[[["global", "local"], 1]]),
    _arch("bloom"),
    # encoders (AutoModel)
    _arch("bert", ENCODER),
    _arch("roberta", ENCODER),
    _arch("xlm-roberta", ENCODER),
    _arch("camembert", ENCODER),
    _arch("electra", ENCODER, embedding_size=32),
    _arch("distilbert", ENCODER),
    _arch("roberta-prelayernorm", ENCODER),
    _arch("ernie", ENCODER),
    _arch("eurobert", ENCODER),
    _arch("albert", ENCODER, embedding_size=32),
    _arch("mpnet", ENCODER),
    _arch("deberta-v2", ENCODER),
    _arch("modernbert", ENCODER),
    # encoder-decoder (AutoModelForSeq2SeqLM)
    _arch("bart", SEQ2SEQ),
    _arch("marian", SEQ2SEQ),
    _arch("mbart", SEQ2SEQ),
    _arch("t5", SEQ2SEQ),
    _arch("mt5", SEQ2SEQ),
    # vision / multimodal towers (AutoModel)
    _arch("vit", VISION),
    _arch("deit", VISION),
    _arch("dinov2", VISION),
    _arch("clip_text_model", ENCODER),
    _arch("clip_vision_model", VISION),
    _arch("siglip_vision_model", VISION),
]


def _where(exc: BaseException) -> str:
    """``path:line`` of the innermost frame, relative to site-packages or the repository."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    path = Path(frame.filename).as_posix()
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        if "/hf_kernel_attn/" in path:
            path = "hf_kernel_attn/" + path.rsplit("/hf_kernel_attn/", 1)[1]
    return f"{path}:{frame.lineno}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [""])[0]


def is_clear_refusal(exc: BaseException, where: str) -> bool:
    """A deliberate refusal: a ValueError / NotImplementedError raised by hf_kernel_attn's own code."""
    return isinstance(exc, (ValueError, NotImplementedError)) and where.startswith("hf_kernel_attn/")


def _main_output(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0]


def build_reference(arch: Architecture) -> tuple[Any, torch.nn.Module, str]:
    """``(config, model, attn_implementation)``: the seeded tiny model in eval mode (SDPA, else eager)."""
    import transformers

    config = arch.config()
    auto = getattr(transformers, arch.auto())
    for impl in ("sdpa", "eager"):
        torch.manual_seed(SEED)
        try:
            model = auto.from_config(copy.deepcopy(config), attn_implementation=impl)
        except ValueError as exc:  # "does not support an attention implementation through torch...sdpa"
            if impl == "sdpa" and "scaled_dot_product_attention" in str(exc):
                continue
            raise
        return config, model.eval(), impl
    raise AssertionError("unreachable")


def _cell_from_exception(exc: BaseException, stage: str) -> dict[str, Any]:
    where = _where(exc)
    return {
        "status": "refused" if is_clear_refusal(exc, where) else "error",
        "error": f"{type(exc).__name__}: {first_line(exc)}",
        "where": where,
        "stage": stage,
    }


def _recording(module: torch.nn.Module, method: Any, called: set[int]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        called.add(id(module))
        return method(*args, **kwargs)

    return wrapper


def run_kernel(model: torch.nn.Module, inputs: dict[str, torch.Tensor], kernel: str,
               reference: torch.Tensor | None = None) -> dict[str, Any]:
    """Patch a deep copy of ``model`` with ``kernel``, run ``inputs``, and describe the outcome (one cell)."""
    patched = copy.deepcopy(model)
    torch.manual_seed(SEED + 1)
    try:
        hf_kernel_attn.patch(patched, kernel=kernel)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, classified by the caller
        return _cell_from_exception(exc, "patch")
    attached = [m for m in patched.modules() if isinstance(m, Kernel)]
    called: set[int] = set()
    hooks = [m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for m in attached]
    for m in attached:  # a caching forward runs linear kernels through forward_with_state (the recurrent cache)
        if hasattr(m, "forward_with_state"):
            m.forward_with_state = _recording(m, m.forward_with_state, called)
    try:
        with torch.no_grad():
            out = _main_output(patched(**inputs))
    except Exception as exc:  # noqa: BLE001
        return _cell_from_exception(exc, "forward")
    finally:
        for h in hooks:
            h.remove()
    cell: dict[str, Any] = {"status": "ok", "kernels_called": f"{len(called)}/{len(attached)}"}
    if len(called) < len(attached):
        impls = sorted({str(getattr(getattr(m, "config", None), "_attn_implementation", None))
                        for m in attention_modules(patched)} - {kernel})
        why = f" (attention modules read a config whose attn_implementation is {impls})" if impls else ""
        cell.update(status="not run",
                    error=f"only {len(called)} of {len(attached)} attached kernels were called{why}")
    elif not bool(torch.isfinite(out).all()):
        cell.update(status="non-finite", error="the output holds NaN or inf")
    elif reference is not None:
        diff = float((out - reference).abs().max())
        cell["max_abs_diff"] = diff
        if not diff <= SOFTMAX_ATOL:
            cell.update(status="mismatch", error=f"softmax differs from the reference by {diff:.3g}")
    return cell


def run_architecture(arch: Architecture, kernels: Iterable[str] = KERNELS) -> dict[str, Any]:
    """One row: the architecture, its model class and reference attention, and one cell per kernel."""
    start = time.perf_counter()
    row: dict[str, Any] = {"architecture": arch.name, "model_type": arch.model_type, "kind": arch.kind,
                           "overrides": dict(arch.overrides), "cells": {}}
    try:
        config, model, impl = build_reference(arch)
        inputs = arch.inputs(config)
        with torch.no_grad():
            reference = _main_output(model(**inputs))
    except Exception as exc:  # noqa: BLE001 - the row says the tiny model itself could not be built or run
        row.update(model_class="?", reference="?", attention_layers=0,
                   build_error=f"{type(exc).__name__}: {first_line(exc)}", build_where=_where(exc),
                   seconds=time.perf_counter() - start)
        return row
    row.update(model_class=type(model).__name__, reference=impl, attention_layers=len(attention_modules(model)))
    for kernel in kernels:
        row["cells"][kernel] = run_kernel(model, inputs, kernel, reference if is_softmax(kernel) else None)
    row["seconds"] = time.perf_counter() - start
    return row


def run_all(architectures: Iterable[Architecture] = ARCHITECTURES, kernels: Iterable[str] = KERNELS,
            progress: Any = None) -> list[dict[str, Any]]:
    """Every row; ``progress(row)`` is called after each architecture."""
    rows = []
    kernels = tuple(kernels)
    for arch in architectures:
        row = run_architecture(arch, kernels)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def all_ok(row: dict[str, Any]) -> bool:
    return "build_error" not in row and bool(row["cells"]) and all(
        c["status"] == "ok" for c in row["cells"].values())


def _error_groups(row: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(kernels, error, where)`` per distinct failure of a row; kernels is "" when every kernel hit it."""
    if "build_error" in row:
        return [("", f"tiny model could not be built: {row['build_error']}", row["build_where"])]
    by_error: dict[tuple[str, str], list[str]] = {}
    for kernel, cell in row["cells"].items():
        if cell["status"] != "ok":
            by_error.setdefault((cell["error"], cell.get("where", "")), []).append(kernel)
    return [("" if len(ks) == len(row["cells"]) else ", ".join(ks), error, where)
            for (error, where), ks in by_error.items()]


def row_errors(row: dict[str, Any]) -> list[str]:
    """The distinct error messages of a row, each with the kernels it hit and where it was raised."""
    return [f"{who + ': ' if who else ''}{error}{f' ({where})' if where else ''}"
            for who, error, where in _error_groups(row)]


def _md(text: str, limit: int | None = None) -> str:
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]], kernels: Iterable[str] = KERNELS) -> str:
    """A Markdown table: architecture, model class, attention layers found, one status per kernel, errors."""
    kernels = tuple(kernels)
    lines = [
        "| architecture | model class | attention layers | " + " | ".join(kernels) + " | error (raised at) |",
        "|---|---|---|" + "---|" * len(kernels) + "---|",
    ]
    for row in rows:
        cells = [row["cells"].get(k, {}).get("status", "–") for k in kernels]
        cls = row.get("model_class", "?")
        if row.get("reference") == "eager":
            cls += " (eager reference)"
        errors = "<br>".join(
            f"{_md(who) + ': ' if who else ''}{_md(error, 200)}{f' (`{where}`)' if where else ''}"
            for who, error, where in _error_groups(row))
        lines.append(f"| {_md(row['architecture'])} | {cls} | {row.get('attention_layers', 0)} | "
                     + " | ".join(cells) + f" | {errors} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict[str, Any]]) -> str:
    """One line: how many architectures run every kernel, are refused, or fail otherwise."""
    ok = sum(all_ok(r) for r in rows)
    clear = sum(
        (not all_ok(r)) and "build_error" not in r
        and all(c["status"] in ("ok", "refused") for c in r["cells"].values())
        for r in rows
    )
    return (f"{len(rows)} architectures: {ok} run all {len(KERNELS)} kernels, {clear} are refused with a clear "
            f"error, {len(rows) - ok - clear} fail otherwise")
