"""Is the linear branch of a sliding-window hybrid used? Switch it off, measure its share of the normaliser,
and build the window-only model of the same weights.

For a hybrid layer (a feature-map kernel with ``window=W``) the normaliser of query i is
window_i + far_i, window_i = Σ_{j∈win(i)} e^{s q·k}, far_i = λ Σ_{j∉win(i)} w_ij φ(q)·φ(k) (kernels/linear/window.py);
far / (window + far) is the share of attention weight the feature map carries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import KernelAttentionConfig, LayerChoice
from ..kernels import SOFTMAX, LinearKernel
from ..kernels.base import group_queries
from ..kernels.linear.spec import HybridCall
from ..kernels.linear.window import branch_normalisers
from .attention import KERNEL_ATTR
from .patching import apply_config, attention_modules, kernel_config


def hybrid_layers(model: nn.Module) -> dict[int, LinearKernel]:
    """{layer index: kernel} of the layers running a windowed feature-map kernel."""
    kernels = [getattr(m, KERNEL_ATTR, None) for m in attention_modules(model)]
    return {i: k for i, k in enumerate(kernels) if isinstance(k, LinearKernel) and k.window}


@contextlib.contextmanager
def linear_branch_off(model: nn.Module) -> Iterator[list[int]]:
    """Inside, every hybrid layer computes softmax over its window alone (λ = 0 on the feature-map part);
    yields the layers switched."""
    layers = hybrid_layers(model)
    before = {i: k.linear_branch_off for i, k in layers.items()}
    for k in layers.values():
        k.linear_branch_off = True
    try:
        yield sorted(layers)
    finally:
        for i, k in layers.items():
            k.linear_branch_off = before[i]


@torch.no_grad()
def normaliser_shares(model: nn.Module, input_ids: torch.Tensor) -> dict[int, dict[str, float]]:
    """Per hybrid layer, the feature-map share far / (window + far) of the normaliser, averaged over heads and
    over the queries that have keys outside their window (position ≥ W), on one forward of ``input_ids``
    (no padding); also the share's mean over every query. NaN for a delta-rule layer (kind ``"delta"``), whose
    memory read-out is added to the window's output instead of sharing its normaliser."""
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("the model has no sliding-window hybrid layer (a feature-map kernel with window=W > 0); "
                         "there is no linear branch to measure next to a window")
    found: dict[int, dict[str, float]] = {}

    def hook_for(idx: int, kernel: LinearKernel):
        def hook(module, args, kwargs, output):
            q, k = args[0], args[1]
            scaling = kwargs.get("scaling") or q.shape[-1] ** -0.5
            fq, fk = kernel.features(q, k, scaling)
            call = HybridCall(causal=kwargs.get("causal", True), key_mask=kwargs.get("key_mask"),
                              log_mix=kernel.branch_log_mix(k.shape[1], k.device))
            win, far = branch_normalisers(group_queries(q, k.shape[1]), k, fq, fk, kernel.hybrid_spec(scaling), call,
                                          log_gate=kernel.gates(k, scaling) if kernel.is_gated else None)
            share = far / (win + far).clamp_min(torch.finfo(far.dtype).tiny)  # [B, Hkv, G, N]
            n = share.shape[-1]
            far_rows = share[..., kernel.window:] if n > kernel.window else share[..., :0]
            found[idx] = {"share_beyond_window": float(far_rows.mean()) if far_rows.numel() else float("nan"),
                          "share_all_queries": float(share.mean()), "window": kernel.window}
        return hook

    # a delta-rule memory has no normaliser to share with the window (its read-out is added): no share to report
    for i, k in layers.items():
        if k.kind == "delta":
            found[i] = {"share_beyond_window": float("nan"), "share_all_queries": float("nan"), "window": k.window}
    handles = [k.register_forward_hook(hook_for(i, k), with_kwargs=True) for i, k in layers.items()
               if k.kind != "delta"]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return dict(sorted(found.items()))


def window_only_config(model: nn.Module) -> KernelAttentionConfig:
    """The model's kernel config with every hybrid layer replaced by softmax over the same window and sinks
    (``softmax`` with ``window=W`` and, where the hybrid has them, ``sinks=S``); every other layer as it is."""
    kcfg = kernel_config(model)
    if kcfg is None:
        raise ValueError("the model is not patched with an hf_kernel_attn kernel")
    layers = hybrid_layers(model)
    if not layers:
        raise ValueError("the model has no sliding-window hybrid layer to turn into a window-only layer")
    choices: dict[int, Any] = {i: kcfg.for_layer(i) for i in range(len(attention_modules(model)))}
    for i, k in layers.items():
        sinks = getattr(k.options, "sinks", 0)
        choices[i] = LayerChoice(SOFTMAX, {"window": k.window, **({"sinks": sinks} if sinks else {})})
    return KernelAttentionConfig(kernel=kcfg.kernel, params=dict(kcfg.params), layers=choices)


def to_window_only(model: nn.Module) -> nn.Module:
    """Re-patch ``model`` in place as :func:`window_only_config` (the feature-map parameters are dropped)."""
    return apply_config(model, window_only_config(model))
