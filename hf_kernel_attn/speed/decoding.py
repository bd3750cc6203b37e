"""Decoding measurements on a patched model: agreement with full recomputation, cache size, and
per-token latency against context length (softmax with a K/V cache vs the recurrent state)."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..integration.attention import KERNEL_ATTR
from ..integration.cache import RecurrentStateCache, RecurrentStateLayer, cache_bytes, cache_kwarg, new_cache
from ..integration.modules import attention_modules
from ..integration.swap import patch
from ..kernel_args import SAVED, parse_kernel_spec
from ..kernels import SOFTMAX, is_softmax, kernel_class
from ..kernels.base import accum
from ..kernels.linear.state import LinearState, SinkSet, SparseCache


@torch.no_grad()
def compare_with_recomputation(model, batch: dict[str, torch.Tensor], new_tokens: int) -> dict[str, Any]:
    """Greedy ``generate`` with the automatic cache vs step-by-step recomputation of the whole sequence
    (``use_cache=False``): are the tokens identical, and how far apart are the step logits?"""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    cached = model.generate(**batch, **kw)
    full = model.generate(**batch, use_cache=False, **kw)
    a, b = torch.stack(cached.logits, 1), torch.stack(full.logits, 1)
    diff = (a - b).abs().max().item()
    return {"tokens_identical": bool(torch.equal(cached.sequences, full.sequences)), "max_abs_logit_diff": diff,
            "max_rel_logit_diff": diff / b.abs().max().item(), "new_tokens": new_tokens}


@torch.no_grad()
def cache_bytes_after(model, input_ids: torch.Tensor, new_tokens: int) -> int:
    """Bytes held by generate's cache after ``new_tokens`` greedy tokens."""
    cache = new_cache(model)
    model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   **{cache_kwarg(model): cache})
    return cache_bytes(cache)


@torch.no_grad()
def synthetic_cache(model, context: int, *, batch: int = 1, seed: int = 0):
    """The cache ``generate`` would hold after ``context`` tokens, filled with random content instead of
    running the prefill: K/V ``[B, Hkv, context, D]`` for softmax-like layers, a random state S, z for
    linear ones. Per-token decode cost depends only on these sizes, so long contexts can be timed
    without a long (for softmax, quadratic) prefill."""
    gen = torch.Generator().manual_seed(seed)
    param = next(model.parameters())
    cache = new_cache(model)
    for idx, module in enumerate(attention_modules(model)):
        kernel = getattr(module, KERNEL_ATTR, None)
        if kernel is None:
            raise ValueError("synthetic_cache needs a model patched with hf_kernel_attn (patch(model, kernel=...))")
        hkv, d = kernel.shape.num_kv_heads, kernel.shape.head_dim
        layer = cache.layers[idx] if isinstance(cache, RecurrentStateCache) else None
        if isinstance(layer, RecurrentStateLayer):
            f = kernel.num_features()
            dtype = accum(param).dtype
            s_mat = torch.rand(batch, hkv, f, d, generator=gen, dtype=dtype).to(param.device)
            z = (1.0 + torch.rand(batch, hkv, f, generator=gen, dtype=dtype)).to(param.device)
            layer.lazy_initialization(z, z)
            sinks = None
            count = getattr(kernel.options, "sinks", 0)
            if count:  # the first S tokens' keys/values, as a prefill of that length would have kept them
                sk, sv = (torch.randn(batch, hkv, count, d, generator=gen).to(param.device, param.dtype) for _ in "kv")
                sinks = SinkSet(sk, sv, torch.arange(count, device=param.device).expand(batch, count).clone(),
                                torch.ones(batch, count, dtype=torch.bool, device=param.device),
                                torch.full((batch,), context, dtype=torch.long, device=param.device), context)
            sparse = None
            capacity, block = getattr(kernel.options, "sparse_cache", 0), getattr(kernel.options, "sparse_block", 1)
            if capacity:  # every slot filled, as after a prefill that long; the pending slots too
                sparse = SparseCache.empty(*(torch.empty(batch, hkv, 0, d, dtype=param.dtype, device=param.device)
                                             for _ in "kv"), capacity, block)
                for name in ("keys", "values", "pending_keys", "pending_values"):
                    t = getattr(sparse, name)
                    t.copy_(torch.randn(t.shape, generator=gen).to(t))
                sparse.pos.copy_(torch.arange(capacity).expand_as(sparse.pos))
                sparse.valid.fill_(True)
                folded = torch.arange(context - kernel.window - block + 1, context - kernel.window + 1)
                sparse.pending_pos[folded % block] = folded.to(sparse.pending_pos.device)
                sparse.pending_ok.fill_(True)
            layer.state = LinearState(s_mat, z, sinks, sparse=sparse)
            if kernel.window:  # the last W - 1 keys/values the window keeps
                kw, vw = (torch.randn(batch, hkv, min(context, kernel.window - 1), d, generator=gen).to(
                    param.device, param.dtype) for _ in "kv")
                layer.window_keys, layer.window_values = kw, vw
            layer.cumulative_length = context
        else:
            k, v = (torch.randn(batch, hkv, context, d, generator=gen).to(param.device, param.dtype) for _ in "kv")
            cache.update(k, v, idx)
    return cache


DECODE_WARMUP = 2  # untimed decode steps before the timed ones


def _prepare(model, context: int, synthetic: bool):
    """The cache of one sequence after ``context`` random tokens (a prefill, or with ``synthetic`` a random cache of
    those sizes: :func:`synthetic_cache`), the next token, and the prefill's seconds (None when synthetic)."""
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    if synthetic:
        return synthetic_cache(model, context), torch.randint(0, model.config.vocab_size, (1, 1), generator=gen).to(
            device), None
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    cache = new_cache(model)
    start = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return cache, out.logits[:, -1:].argmax(-1), time.perf_counter() - start


def _timed_step(model, cache, token: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model(token, use_cache=True, **{cache_kwarg(model): cache})
    return time.perf_counter() - start, out.logits[:, -1:].argmax(-1)


def _models_to_compare(model, kernels: Sequence[str], longest: int) -> dict[str, tuple[Any, dict[str, Any]]]:
    """{spec: (model, params)}: ``saved`` is ``model`` as loaded (its saved kernels, per layer); every other spec a
    copy of it patched with that kernel (softmax first). cosformer gets ``horizon`` = the longest position when
    that exceeds the model's max positions."""
    found = {}
    for kernel in kernels:
        if kernel == SAVED:
            if not any(getattr(m, KERNEL_ATTR, None) is not None for m in attention_modules(model)):
                raise ValueError(f"decode-bench: {SAVED!r} names the kernels the model was saved with, but "
                                 "this model carries none (a converted model folder has kernel_attention in its "
                                 "config.json); name kernels instead")
            found[kernel] = (model, {})
            continue
        name, params = parse_kernel_spec(kernel)
        horizon = kernel_class(name).horizon_option  # cosformer refuses positions past its horizon
        if horizon and longest > getattr(model.config, "max_position_embeddings", longest):
            params.setdefault(horizon, longest)
        copy_ = copy.deepcopy(model)
        patch(copy_, kernel=name, **params)
        found[kernel] = (copy_, params)
    return found


@torch.no_grad()
def run_decode_suite(model, kernels: Sequence[str], contexts: Sequence[int], *, steps: int = 8,
                     synthetic: bool = False, progress=None) -> list[dict[str, Any]]:
    """Per-token decode latency of every kernel at every context, ``softmax`` (K/V cache) always among them;
    ``saved`` = the kernels ``model`` was loaded with. Each kernel runs on its own copy of the model; at each
    context every copy is prefilled, then the decode steps are interleaved (step s of every kernel, then step
    s + 1), so a change of the machine's load falls on all kernels alike; the median step is reported
    (``decode_ms``), and the mean (``decode_ms_mean``: what a generation of many tokens pays per token, work done
    every few steps included, as a sparse cache's re-choice every ``sparse_block`` positions).
    Adds ``ratio_vs_softmax`` (same context; ``ratio_mean_vs_softmax`` of the means) and ``ratio_vs_shortest``
    (same kernel, shortest context)."""
    kernels = [SOFTMAX, *[k for k in kernels if not is_softmax(k)]]
    models = _models_to_compare(model, kernels, max(contexts) + steps + DECODE_WARMUP)
    rows = []
    for context in contexts:
        prepared = {k: _prepare(m, context, synthetic) for k, (m, _) in models.items()}
        tokens = {k: token for k, (_, token, _) in prepared.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        for step in range(DECODE_WARMUP + steps):
            for k, (m, _) in models.items():
                took, tokens[k] = _timed_step(m, prepared[k][0], tokens[k])
                if step >= DECODE_WARMUP:
                    times[k].append(took)
        for k, (_, params) in models.items():
            cache, _, prefill = prepared[k]
            row = {"kernel": k, "params": params, "context": context, "prefill_s": prefill,
                   "prefill_tokens_per_s": None if prefill is None else context / prefill,
                   "decode_ms": 1e3 * statistics.median(times[k]), "decode_ms_mean": 1e3 * statistics.fmean(times[k]),
                   "cache_bytes": cache_bytes(cache),
                   "synthetic": synthetic}
            rows.append(row)
            if progress:
                progress(row)
        del prepared
    base = {r["context"]: r["decode_ms"] for r in rows if is_softmax(r["kernel"])}
    base_mean = {r["context"]: r["decode_ms_mean"] for r in rows if is_softmax(r["kernel"])}
    first = {}
    for r in rows:
        first.setdefault(r["kernel"], r["decode_ms"])
        r["ratio_vs_softmax"] = r["decode_ms"] / base[r["context"]]
        r["ratio_mean_vs_softmax"] = r["decode_ms_mean"] / base_mean[r["context"]]
        r["ratio_vs_shortest"] = r["decode_ms"] / first[r["kernel"]]
    rows.sort(key=lambda r: kernels.index(r["kernel"]))  # kernel by kernel, contexts in order (stable sort)
    return rows
