"""Kernel geometry: κ(x₀, x) over a plane, and kernel values / attention maps of real queries and keys.

Every number goes through the package's own kernel modules (``build_kernel``) or, for the softmax-like
kernels whose modules only return normalised outputs, through their defining formula with the module's
own parameters:

* exponential (dot product, softmax's kernel): κ = exp(s q·k) — no maximum; grows without bound along q;
* Gaussian: κ = exp(−‖q − k‖²/(2σ²)), 1/σ² = the module's ``inv_sigma_sq`` — one maximum, at k = q;
* cosine (QK-norm): κ = exp(g q̂·k̂) — depends on the angle only, constant along rays from 0;
* feature maps (elu+1, performer, hedgehog, …): κ = φ(q)·φ(k) from the module's ``features``.

Row-normalised, κ becomes attention: w_ij = κ(q_i, k_j) / Σ_j' κ(q_i, k_j'). ``attention_map`` reads
w off the module's forward with one-hot values (v = I), so it is the implementation, not a re-derivation.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any

import torch

from ..integration.patching import attention_modules
from ..kernels import LayerShape, build_kernel

GEOMETRY_KERNELS = ("gaussian", "softmax", "cosine", "elu", "performer", "hedgehog")
GEOMETRY_TITLES = {
    "gaussian": "Gaussian exp(−‖x₀−x‖²/2)", "softmax": "exponential exp(x₀·x)", "cosine": "cosine exp(2 cos(x₀,x))",
    "elu": "elu+1 φ(x₀)·φ(x)", "performer": "performer (1024 features)", "hedgehog": "hedgehog (identity init)",
}
# options for the 2-D panels: σ = 1, s = 1, cosine gain 2, performer with many features so that its
# estimate of exp(x₀·x) is visible; the others at their defaults
GEOMETRY_PARAMS: dict[str, dict[str, Any]] = {
    "gaussian": {"sigma": 1.0}, "cosine": {"gain": 2.0}, "performer": {"num_features": 1024, "seed": 0},
}


@torch.no_grad()
def log_kernel(kernel: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """log κ(q_i, k_j) for every head: q ``[B, H, N, D]``, k ``[B, Hkv, M, D]`` -> ``[B, H, N, M]`` (fp64), from
    the kernel's own definition (``Kernel.log_scores``)."""
    state = list(kernel.state_dict().values())
    work = kernel if all(t.dtype == torch.float64 for t in state) else copy.deepcopy(kernel).double()
    try:
        return work.log_scores(q.double(), k.double(), scaling)
    except NotImplementedError:
        raise ValueError(f"no kernel-value formula for kernel {kernel.name!r}") from None


def attention_map(kernel: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, scaling: float,
                  causal: bool = True) -> torch.Tensor:
    """The attention weights the kernel module computes: its forward on one-hot values (v = I, one column per
    key), so out[b, i, h, j] = w_ij. Returns ``[B, H, N, M]``."""
    b, hkv, m, _ = k.shape
    v = torch.eye(m, dtype=q.dtype).expand(b, hkv, m, m).contiguous()
    with torch.no_grad():
        out = kernel(q, k, v, key_mask=None, causal=causal, scaling=scaling)
    return out.transpose(1, 2).float()


def geometry_kernel(name: str, head_dim: int = 2) -> torch.nn.Module:
    return build_kernel(name, LayerShape(1, 1, head_dim), GEOMETRY_PARAMS.get(name, {})).eval()


def plane_grid(extent: float = 3.0, points: int = 121) -> tuple[torch.Tensor, torch.Tensor]:
    """Axis ``[points]`` and grid points ``[points², 2]`` (row-major: y outer, x inner)."""
    axis = torch.linspace(-extent, extent, points, dtype=torch.float64)
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    return axis, torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)


def kernel_on_plane(name: str, x0: tuple[float, float], points: torch.Tensor, scaling: float = 1.0
                    ) -> torch.Tensor:
    """log κ(x₀, x) for every x in ``points [P, 2]`` (x₀ the query, x the key), through the kernel module."""
    kernel = geometry_kernel(name)
    q = torch.tensor(x0, dtype=torch.float64).view(1, 1, 1, 2)
    k = points.view(1, 1, -1, 2)
    return log_kernel(kernel, q, k, scaling)[0, 0, 0]


def geometry(x0: tuple[float, float] = (1.0, 0.5), extent: float = 3.0, points: int = 121,
             kernels: tuple[str, ...] = GEOMETRY_KERNELS) -> dict[str, Any]:
    """log κ(x₀, ·) on a grid for each kernel, plus the numbers the plots show: where the maximum on the
    plane is, whether it is in the interior (a peak) or on the border (unbounded growth), the values along
    the ray t·x₀ and along the circle |x| = |x₀|."""
    axis, grid = plane_grid(extent, points)
    x0t = torch.tensor(x0, dtype=torch.float64)
    ts = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.0, 2.5], dtype=torch.float64)
    ray = ts[:, None] * x0t
    angles = torch.linspace(0, 2 * math.pi, 13, dtype=torch.float64)[:-1]
    circle = x0t.norm() * torch.stack([angles.cos(), angles.sin()], -1)
    out: dict[str, Any] = {"x0": list(x0), "extent": extent, "points": points, "axis": axis.tolist(),
                           "ray_t": ts.tolist(), "circle_angles": angles.tolist(), "kernels": {}}
    for name in kernels:
        logk = kernel_on_plane(name, x0, grid)
        i = int(logk.argmax())
        arg = grid[i]
        on_border = bool(arg.abs().max() >= extent - 1e-9)
        out["kernels"][name] = {
            "title": GEOMETRY_TITLES.get(name, name), "params": GEOMETRY_PARAMS.get(name, {}),
            "log_kappa": logk.view(points, points).tolist(),
            "argmax": arg.tolist(), "max_log_kappa": float(logk.max()), "argmax_on_border": on_border,
            "log_kappa_at_x0": float(kernel_on_plane(name, x0, x0t.view(1, 2))[0]),
            "log_kappa_along_ray": kernel_on_plane(name, x0, ray).tolist(),
            "log_kappa_on_circle": kernel_on_plane(name, x0, circle).tolist(),
        }
    return out


def _forward_params(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def layer_qkv(model, layer: int, input_ids: torch.Tensor) -> dict[str, Any]:
    """q, k, v (after RoPE) and the softmax scale that layer ``layer`` hands its kernel, captured by a forward
    pre-hook on ``<attention>.kernel_attn`` (the model must be patched, softmax included)."""
    modules = attention_modules(model)
    if not -len(modules) <= layer < len(modules):
        raise ValueError(f"layer {layer} out of range: the model has {len(modules)} attention layers")
    kernel = modules[layer].kernel_attn
    seen: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        q, k, v = args[:3]
        seen.update(q=q.detach().float(), k=k.detach().float(), v=v.detach().float(),
                    scaling=kwargs.get("scaling"), causal=kwargs.get("causal", True))

    handle = kernel.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            # no cache: a caching forward runs linear kernels through forward_with_state, past this hook
            model(input_ids=input_ids, **({"use_cache": False} if "use_cache" in _forward_params(model) else {}))
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"layer {layer}'s kernel was not called")
    seen["kernel"] = kernel
    if seen["scaling"] is None:
        seen["scaling"] = seen["q"].shape[-1] ** -0.5
    return seen


def row_entropy(w: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row."""
    return -(w.clamp_min(1e-30).log() * w).sum(-1)
