"""KV-cache compression baselines: an unconverted softmax model with a ``kvpress`` press (NVIDIA's kvpress,
an optional dependency), run the way kvpress's own ``kv-press-text-generation`` pipeline runs it, so that its
scores and cache bytes sit beside the constant-memory kernels' at the same bytes.

How kvpress compresses (read from kvpress 0.5.5, checked on SmolLM2-135M):

* only the **prefill of the context**: ``with press(model): model.model(context_ids, past_key_values=cache)``
  (forward hooks on every attention module prune that layer's keys and values once the layer has run, so later
  layers still see the whole context); the question is fed afterwards, uncompressed, with position ids that go on
  from the *uncompressed* context length, then greedy decoding one token at a time;
* ``compression_ratio`` r is the fraction of the context's K/V pairs removed: a scorer press keeps
  ``max(1, int(n * (1 - r)))`` pairs per layer and KV head, so the cache after the context holds that share of
  the bytes (exactly, up to the floor). KVzip (and AdaKV-style head-wise presses) do **not** free memory: they
  keep the tensors and mask the evicted keys at attention time (``module.masked_key_indices``), so their bytes are
  counted here as the pairs they keep (:func:`kept_cache_bytes`);
* query-agnostic when the question is not in the context (the kvpress benchmark convention, and this module's):
  SnapKV's observation window is then the last 64 context tokens, TOVA's the last one.

kvpress pins ``transformers<5.3`` and, on import, wraps every attention function in transformers'
``ALL_ATTENTION_FUNCTIONS`` (its head-wise masking patch): it is imported only when a press is made.

API: :data:`PRESSES` (name -> factory), :func:`make_press`, :func:`press_runner` / :class:`PressRunner` (prefill
with the press, then question + greedy answer, or a teacher-forced pass), :func:`cache_bytes`, :func:`kept_cache_bytes`,
:func:`ratio_for_bytes` (the ratio that leaves a target number of bytes), :func:`require_kvpress`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..integration.cache import cache_bytes as _layer_bytes
from ..integration.patching import kernel_config
from ..kernels.linear.sparse_cache import MASS_FLOOR
from ..registry import Registry

KVPRESS_INSTALL = ("pip install 'hf_kernel_attn[press]' in an environment with transformers>=5.2,<5.3 (kvpress "
                   "pins transformers<5.3), e.g. the one `bash scripts/setup.sh --press` makes")

PressFactory = Callable[..., Any]  # (compression_ratio, **options) -> a kvpress BasePress

PRESSES: Registry[PressFactory] = Registry(
    "KV-cache press", hint="add one with hf_kernel_attn.evaluation.presses.PRESSES.register(name, factory)")


# ------------------------------------------------------------------------------------------- kvpress, optional
def require_kvpress():
    """The ``kvpress`` module; ImportError naming ``pip install kvpress`` and the transformers pin when it is not
    installed, or when the installed transformers is outside the range that kvpress release declares."""
    if importlib.util.find_spec("kvpress") is None:
        raise ImportError(f"the KV-cache press baselines need kvpress, which is not installed: {KVPRESS_INSTALL}")
    _check_transformers_pin()
    return importlib.import_module("kvpress")


def _check_transformers_pin() -> None:
    from packaging.requirements import Requirement  # packaging: a dependency of transformers

    try:
        requires = importlib.metadata.requires("kvpress") or []
        found = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return
    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is None and not req.specifier.contains(found, prereleases=True):
            raise ImportError(f"kvpress {importlib.metadata.version('kvpress')} needs transformers{req.specifier}, "
                              f"this environment has transformers {found}: {KVPRESS_INSTALL}")


def _kvpress_press(class_name: str, **fixed: Any) -> PressFactory:
    def factory(compression_ratio: float, **options: Any):
        return getattr(require_kvpress(), class_name)(compression_ratio=compression_ratio, **{**fixed, **options})

    factory.__name__ = factory.__qualname__ = f"make_{class_name}"
    factory.__doc__ = f"kvpress.{class_name}(compression_ratio, **options)"
    return factory


PRESSES.register("streaming_llm", _kvpress_press("StreamingLLMPress"))
PRESSES.register("snapkv", _kvpress_press("SnapKVPress"))
PRESSES.register("tova", _kvpress_press("TOVAPress"))
PRESSES.register("expected_attention", _kvpress_press("ExpectedAttentionPress"))
PRESSES.register("knorm", _kvpress_press("KnormPress"))
PRESSES.register("kvzip", _kvpress_press("KVzipPress"))


# ------------------------------------------------------------------------------ the project's own score as a press
def recall_error_scores(keys: torch.Tensor, values: torch.Tensor, *, n_sink: int = 4, window: int = 64,
                        eps: float = 1e-6) -> torch.Tensor:
    """The bounded sparse cache's rule (:mod:`hf_kernel_attn.kernels.linear.sparse_cache`) applied once to a whole
    prefilled context: each key outside the sinks and the last ``window`` positions is scored by its self-recall
    error ‖v_j − S'ᵀφ(k_j) / max(z'ᵀφ(k_j), ρ zᵀφ(k_j), eps)‖² against the linear state S', z' of every *other*
    out-of-window key (φ = elu + 1, parameter-free: the model is unconverted; ρ = MASS_FLOOR); sinks and window get
    the highest score, so they are kept first. ``keys``/``values`` ``[B, Hkv, L, D]`` -> ``[B, Hkv, L]``.

    Differences from the converted model's cache, on purpose for a one-shot press: the decision is taken once at
    the end of the prefill (not every ``sparse_block`` positions), and φ is fixed, not a trained feature map."""
    length = keys.shape[2]
    scores = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
    lo, hi = min(n_sink, length), max(min(n_sink, length), length - window)
    if hi > lo:
        k, v = keys[:, :, lo:hi].float(), values[:, :, lo:hi].float()
        fk = torch.nn.functional.elu(k) + 1  # [B, H, N, F]
        aug = torch.cat([v, torch.ones_like(v[..., :1])], -1)  # [B, H, N, Dv + 1]
        state = fk.transpose(-1, -2) @ aug  # [B, H, F, Dv + 1]: every out-of-window key
        read = fk @ state - (fk * fk).sum(-1, keepdim=True) * aug  # leave-one-out: S' = S − φ(k_j)[v_j, 1]ᵀ
        z_full = fk @ state[..., -1:]  # zᵀφ(k_j) with k_j in it
        den = torch.maximum(read[..., -1:].clamp_min(eps), MASS_FLOOR * z_full)
        scores[:, :, lo:hi] = (v - read[..., :-1] / den).square().sum(-1)
    top = scores.amax() + 1 if hi > lo else torch.ones((), device=keys.device)
    scores[:, :, :lo] = top
    scores[:, :, hi:] = top
    return scores


@functools.cache
def _recall_error_press_class():
    kvpress = require_kvpress()

    @dataclasses.dataclass
    class SparseCachePress(kvpress.ScorerPress):
        """kvpress ScorerPress keeping the pairs a linear state reproduces worst (:func:`recall_error_scores`),
        plus ``n_sink`` sinks and the last ``window`` positions."""

        compression_ratio: float = 0.0
        n_sink: int = 4
        window: int = 64
        eps: float = 1e-6

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return recall_error_scores(keys, values, n_sink=self.n_sink, window=self.window, eps=self.eps)

    SparseCachePress.__module__ = __name__
    return SparseCachePress


def _sparse_cache_press(compression_ratio: float, **options: Any):
    """The project's sparse-cache score (self-recall error against a linear state) as a kvpress press."""
    return _recall_error_press_class()(compression_ratio=compression_ratio, **options)


PRESSES.register("sparse_cache", _sparse_cache_press)


def press_names() -> list[str]:
    return PRESSES.names()


def make_press(name: str, compression_ratio: float, **options: Any):
    """A kvpress press ``name`` (a key of :data:`PRESSES`) removing ``compression_ratio`` of the context's K/V
    pairs; ValueError for a ratio outside [0, 1), UnknownNameError (a ValueError) for an unknown name."""
    if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float)) \
            or not 0 <= compression_ratio < 1:
        raise ValueError(f"compression ratio must be in [0, 1), got {compression_ratio!r}")
    return PRESSES.get(name)(float(compression_ratio), **options)


# ------------------------------------------------------------------------------------------------- cache bytes
def cache_bytes(cache) -> int:
    """Bytes the cache's tensors hold (keys and values of every layer; a RecurrentStateCache counts its own)."""
    return _layer_bytes(cache)


def _attention_modules(model) -> list[torch.nn.Module]:
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


def kept_cache_bytes(cache, model) -> int:
    """:func:`cache_bytes` less the pairs a head-wise press (KVzip, AdaKV ...) only masks: each masked
    (batch, head, position) entry frees one key and one value row of that layer. Read right after the prefill."""
    total = cache_bytes(cache)
    for module, layer in zip(_attention_modules(model), cache.layers, strict=False):
        masked = getattr(module, "masked_key_indices", None)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if masked is not None and isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            row = keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()
            total -= int(masked[0].numel()) * row
    return total


def _dtype_bytes(config, dtype: torch.dtype | str | None) -> int:
    dtype = dtype if dtype is not None else getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return torch.empty((), dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32).element_size()


def kv_bytes_per_token(config, dtype: torch.dtype | str | None = None) -> int:
    """K and V bytes one position costs in a full softmax cache: 2 · layers · KV heads · head_dim · element size
    (``dtype``: the model's at run time; default the config's ``dtype``, else float32)."""
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * _dtype_bytes(config, dtype)


def ratio_for_bytes(target_bytes: int, config, context_tokens: int, *, dtype: torch.dtype | str | None = None,
                    extra_tokens: int = 0) -> float:
    """The compression ratio after which a ``context_tokens`` prefill (plus ``extra_tokens`` fed uncompressed
    afterwards, e.g. the question) holds at most ``target_bytes`` of K/V, with as many pairs as fit: a scorer press
    keeps ``int(n · (1 - r))`` pairs, so r = 1 − (keep + ½) / n lands on ``keep`` exactly. 0.0 when the whole
    context fits; ValueError when not even one context pair does."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens!r}")
    keep = int(target_bytes // kv_bytes_per_token(config, dtype)) - extra_tokens
    if keep >= context_tokens:
        return 0.0
    if keep < 1:
        raise ValueError(f"{target_bytes} bytes hold {keep + extra_tokens} positions of this model's K/V, not "
                         f"enough for one context pair beside {extra_tokens} uncompressed tokens")
    return 1.0 - (keep + 0.5) / context_tokens


# ---------------------------------------------------------------------------------------- prefill, then decode
@dataclasses.dataclass
class PressResult:
    """One answer: the generated ``tokens`` (an EOS that stopped it included, as kvpress's pipeline keeps it),
    the context length, the pairs kept per layer and head after the press (``kept_tokens``: the cache's length;
    KVzip masks instead, so its kept share is in ``cache_bytes``), the K/V bytes after the context
    (:func:`kept_cache_bytes`) and the compression ratio used."""

    tokens: list[int]
    context_tokens: int
    kept_tokens: int
    cache_bytes: int
    compression_ratio: float


@dataclasses.dataclass
class Prefilled:
    """A context prefilled under ``press``: its ``cache``, the position the next token takes (``start``) and
    the :class:`PressResult` so far (no tokens yet)."""

    cache: Any
    press: Any
    start: int
    result: PressResult


class PressRunner:
    """A softmax causal LM with a press, answering like kvpress's ``kv-press-text-generation`` pipeline: the
    context is prefilled under the press (decoder only, no LM head), the question is fed with position ids going
    on from the uncompressed context length, then greedy decoding until EOS or ``max_new_tokens``.

    Either a fixed ``compression_ratio`` or ``target_bytes`` (each prompt gets :func:`ratio_for_bytes` for its own
    context length, so every prompt's cache holds the bytes of, e.g., a constant-memory kernel's). Use it as a
    context manager: on exit the model is given back as it was (kvpress's hooks are removed after each prefill;
    the ``rotary_emb`` attributes it puts on attention modules and KVzip's masks are taken off)."""

    def __init__(self, model, name: str, compression_ratio: float | None = None, *,
                 target_bytes: int | None = None, options: dict[str, Any] | None = None) -> None:
        if (compression_ratio is None) == (target_bytes is None):
            raise ValueError("give one of compression_ratio and target_bytes")
        attached = kernel_config(model)
        if attached is not None:
            raise ValueError(f"a KV-cache press runs on the unconverted softmax model; this model has the "
                             f"{attached.kernel!r} kernel attached: load it without a kernel")
        self.model, self.name, self.options = model, name, dict(options or {})
        self.compression_ratio, self.target_bytes = compression_ratio, target_bytes
        self._kvpress = require_kvpress()
        PRESSES.get(name)  # an unknown name: UnknownNameError listing the presses
        if compression_ratio is not None:
            make_press(name, compression_ratio, **self.options)  # a bad ratio or option fails now, not mid-run
        self._had_rotary = {id(m) for m in _attention_modules(model) if "rotary_emb" in m._modules}

    def __enter__(self) -> PressRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def restore(self) -> None:
        """Take off what kvpress leaves on the model's attention modules."""
        for module in _attention_modules(self.model):
            if id(module) not in self._had_rotary and "rotary_emb" in module._modules:
                del module._modules["rotary_emb"]
            if getattr(module, "masked_key_indices", None) is not None:
                module.masked_key_indices = None

    def ratio_for(self, context_tokens: int, extra_tokens: int = 0) -> float:
        if self.compression_ratio is not None:
            return float(self.compression_ratio)
        return ratio_for_bytes(self.target_bytes, self.model.config, context_tokens, dtype=self.model.dtype,
                               extra_tokens=extra_tokens)

    def prefill(self, context_ids: Sequence[int] | torch.Tensor, extra_tokens: int = 0) -> Prefilled:
        """The context prefilled under the press (call :meth:`restore` when done with the model): the cache, and
        where the tokens after it go on. ``extra_tokens``: with ``target_bytes``, room left for them."""
        kv = self._kvpress
        ctx = _as_row(context_ids, next(self.model.parameters()).device)
        n = ctx.shape[1]
        ratio = self.ratio_for(n, extra_tokens)
        press = make_press(self.name, ratio, **self.options)
        cache = DynamicCache()
        with press(self.model) if not isinstance(press, kv.DecodingPress) else contextlib.nullcontext():
            self.model.model(input_ids=ctx, past_key_values=cache)
        start = n
        if isinstance(press, (kv.RestoreKVPress, kv.KeyRerotationPress)) or (
                isinstance(press, kv.FinchPress) and press.rerotate_keys):
            start = cache.get_seq_length()
        result = PressResult([], n, cache.get_seq_length(), kept_cache_bytes(cache, self.model), ratio)
        return Prefilled(cache, press, start, result)

    def after_prefill(self, prefilled: Prefilled):
        """The press again for what follows the context when it also compresses while decoding, else a no-op."""
        decoding = isinstance(prefilled.press, (self._kvpress.DecodingPress, self._kvpress.PrefillDecodingPress))
        return prefilled.press(self.model) if decoding else contextlib.nullcontext()

    @torch.no_grad()
    def generate(self, context_ids: Sequence[int] | torch.Tensor, question_ids: Sequence[int] | torch.Tensor, *,
                 max_new_tokens: int, eos_token_id: int | Sequence[int] | None = None,
                 budget_includes_question: bool = False) -> PressResult:
        """Prefill ``context_ids`` under the press, then answer ``question_ids`` greedily (one sequence).
        ``budget_includes_question``: with ``target_bytes``, leave room for the question's uncompressed pairs."""
        question = _as_row(question_ids, next(self.model.parameters()).device)
        try:
            pre = self.prefill(context_ids, question.shape[1] if budget_includes_question else 0)
            with self.after_prefill(pre):
                tokens = self._greedy(question, pre.cache, pre.start, max_new_tokens, eos_token_id)
        finally:
            self.restore()
        return dataclasses.replace(pre.result, tokens=tokens)

    @torch.no_grad()
    def predict(self, context_ids: Sequence[int] | torch.Tensor,
                continuation_ids: Sequence[int] | torch.Tensor) -> tuple[PressResult, torch.Tensor]:
        """Prefill ``context_ids`` under the press, then one teacher-forced pass over ``continuation_ids``: the
        result (no tokens) and the argmax after each continuation token (``[len(continuation_ids)]``)."""
        rest = _as_row(continuation_ids, next(self.model.parameters()).device)
        try:
            pre = self.prefill(context_ids)
            positions = torch.arange(pre.start, pre.start + rest.shape[1], device=rest.device).unsqueeze(0)
            with self.after_prefill(pre):
                logits = self.model(input_ids=rest, past_key_values=pre.cache, position_ids=positions).logits
        finally:
            self.restore()
        return pre.result, logits[0].argmax(-1)

    def generate_prompt(self, ids: Sequence[int], question_start: int, **kwargs: Any) -> PressResult:
        """:meth:`generate` on one prompt split at ``question_start``: context = ids[:question_start]."""
        if not 0 < question_start < len(ids):
            raise ValueError(f"question_start must split the {len(ids)}-token prompt, got {question_start!r}")
        return self.generate(ids[:question_start], ids[question_start:], **kwargs)

    def _greedy(self, question: torch.Tensor, cache, start: int, max_new_tokens: int,
                eos_token_id: int | Sequence[int] | None) -> list[int]:
        model = self.model
        stop = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, (list, tuple, set)) else [stop])
        positions = torch.arange(start, start + question.shape[1], device=question.device).unsqueeze(0)
        out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        positions = positions[:, -1:] + 1
        tokens = [out.logits[0, -1].argmax()]
        for i in range(max_new_tokens - 1):  # as the pipeline: the first token is not checked for EOS
            out = model(input_ids=tokens[-1].view(1, 1), past_key_values=cache, position_ids=positions + i)
            tokens.append(out.logits[0, -1].argmax())
            if int(tokens[-1]) in stop:
                break
        return [int(t) for t in tokens]


def press_runner(model, name: str, compression_ratio: float | None = None, *, target_bytes: int | None = None,
                 **options: Any) -> PressRunner:
    """``with press_runner(model, "snapkv", 0.5) as run: run.generate(context_ids, question_ids, max_new_tokens=8)``
    (or ``target_bytes=`` instead of a ratio). ``options`` go to the press (``window_size``, ``n_sink`` ...)."""
    return PressRunner(model, name, compression_ratio, target_bytes=target_bytes, options=options)


def _as_row(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    row = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    row = row.to(device)
    if row.dim() == 1:
        row = row.unsqueeze(0)
    if row.dim() != 2 or row.shape[0] != 1 or row.shape[1] < 1:
        raise ValueError(f"one sequence of token ids expected, got shape {tuple(row.shape)}")
    return row

