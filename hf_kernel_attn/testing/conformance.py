"""``check_kernel``: a conformance kit for attention kernels, built-in or your own.

Every fast path of a kernel is compared with the brute-force O(N²) evaluation of the kernel's own definition,
``Kernel.scores`` (κ(q_i, k_j); for a feature map φ(q_i)·φ(k_j) times its decay), in float64:

    out_i = Σ_{j visible} κ_ij v_j / Σ_{j visible} κ_ij

with the visibility of the kernel contract (bottom-right causal, key padding). For feature-map kernels the
``window=W`` hybrid is checked too, against

    out_i = (Σ_{j∈win(i)} e^{s q_i·k_j} v_j + Σ_{j∉win(i)} κ_ij v_j) / (Σ_{j∈win(i)} e^{s q_i·k_j} + Σ_{j∉win(i)} κ_ij)

(LoLCATs, Zhang et al. ICLR 2025), with λ_h κ_ij for a learnable mix, and with the ``sinks`` and the bounded
``sparse_cache`` (and ``softmax_heads``) the kernel's options have: win(i) ∪ sinks ∪ cache(i) in the softmax part
(:mod:`.sparse_reference`, the definition evaluated directly). Options a 17-token sequence would not reach are
checked as they are and at kit size (:data:`KIT_HYBRID`); with a sparse cache a bidirectional call must raise the
documented ``ValueError``. A kernel whose output is not of the form Σ κ v / Σ κ (a recurrence, as the delta
rule's memory) defines ``Kernel.reference``, its definition evaluated directly, and that is the brute force instead.
Forms: causal and bidirectional, key padding, GQA and MHA, an odd head dimension, lengths around the chunk size,
decoding (from the recurrent state, or N < M queries for kernels without one; and on the packed layout, for a
hybrid that decodes on it) = recomputation, gradients of q, k, v and the kernel's parameters, and bf16 / fp16 inputs
under autocast (finite, in the input dtype, near fp32). A failure raises ``AssertionError`` naming the kernel, the
form and the error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from ..kernels import Kernel, LayerShape, kernel_class
from ..kernels.base import make_options
from ..kernels.linear.state import PastKeys
from .sparse_reference import hybrid_reference

SHAPES = ((4, 2, 16), (3, 3, 7))  # (query heads, KV heads, head dim): GQA, and MHA with an odd head dim
CHUNK = 8  # feature-map kernels run with chunk_size = 8, so lengths 7, 8, 9, 17 cross chunk boundaries
WINDOW = 5
# the hybrid at kit size (N ≤ 17): sinks leave the window, pairs are cached from position 12 on, boundaries at 4,
# 8, 12, 16 fall inside a prefill, a 3-token chunk and single decode steps
KIT_HYBRID = {"window": WINDOW, "sinks": 2, "sparse_cache": 3, "sparse_block": 4}


@dataclasses.dataclass(frozen=True)
class CheckedLayer:
    """One layer shape under check: the kernel's ``name`` (for messages), ``hq`` query heads, ``hkv`` KV heads,
    head dim ``d``; the inputs' ``seed``; the tolerance ``atol + rtol·|ref|``; ``where``: the shape as form names
    show it."""

    name: str
    hq: int
    hkv: int
    d: int
    seed: int
    atol: float
    rtol: float
    where: str


def _fail(kernel: str, form: str, detail: str) -> None:
    raise AssertionError(f"check_kernel({kernel!r}): {form}: {detail}")


def _visible(b: int, n: int, m: int, causal: bool, key_mask: torch.Tensor | None) -> torch.Tensor:
    i = torch.arange(n)[:, None] + (m - n)
    j = torch.arange(m)[None, :]
    vis = (j <= i) if causal else torch.ones(n, m, dtype=torch.bool)
    vis = vis[None, None].expand(b, 1, n, m)
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    return vis


def _rows(b: int, n: int, m: int, causal: bool, key_mask: torch.Tensor | None) -> torch.Tensor:
    """``[B, N]``: query rows that are real tokens and see a key (the rows a kernel must get right)."""
    rows = _visible(b, n, m, causal, key_mask)[:, 0].any(-1)
    return rows if key_mask is None else rows & key_mask[:, m - n:]


def brute_force(kernel: Kernel, q, k, v, key_mask=None, causal=True, scaling=None) -> torch.Tensor:
    """The kernel's definition evaluated directly: with the explicit N×M matrix of ``scores``, or the kernel's own
    ``reference`` where it defines one (a recurrence such as the delta rule); ``[B, N, Hq, Dv]`` (q's dtype;
    float64 inputs and a float64 kernel for checks)."""
    if type(kernel).reference is not Kernel.reference:  # a definition other than Σ κ v / Σ κ (the delta rule)
        return kernel.reference(q, k, v, key_mask=key_mask, causal=causal, scaling=scaling)
    b, hq, n, d = q.shape
    m = k.shape[-2]
    scaling = d ** -0.5 if scaling is None else scaling
    if kernel.is_linear and getattr(kernel.options, "window", 0):  # the hybrid: window, sinks, sparse cache, λ
        return hybrid_reference(kernel, q, k, v, key_mask, causal, scaling).to(q.dtype)
    vis = _visible(b, n, m, causal, key_mask)
    values = v.repeat_interleave(hq // v.shape[1], 1)
    if kernel.is_linear:  # Σ κ v / max(Σ κ, eps), as the feature-map kernels normalise
        weights = kernel.scores(q, k, scaling) * vis
        den = weights.sum(-1, keepdim=True).clamp_min(kernel.options.eps)
        return ((weights @ values) / den).transpose(1, 2)
    log_kappa = kernel.log_scores(q, k, scaling)
    shift = log_kappa.masked_fill(~vis, float("-inf")).amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weights = (log_kappa - shift).exp() * vis
    den = weights.sum(-1, keepdim=True)
    den = torch.where(den > 0, den, torch.ones_like(den))
    return ((weights @ values) / den).transpose(1, 2)


def _build(cls: type[Kernel], shape: LayerShape, params: dict[str, Any]) -> Kernel:
    kern = cls(shape, make_options(cls.options_cls, cls.name, params))
    kern.reset_parameters()
    torch.manual_seed(shape.layer_idx + 7)
    with torch.no_grad():  # parameters away from their identity-like initialisation, so they matter
        for p in kern.parameters():
            if p.is_floating_point():
                p.add_(0.1 * torch.randn_like(p))
    return kern


def _compare(name: str, form: str, got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor | None,
             atol: float, rtol: float) -> float:
    if got.shape != want.shape:
        _fail(name, form, f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    got, want = got.detach().double(), want.detach().double()
    if rows is not None:
        got, want = got[rows], want[rows]
    if not torch.isfinite(got).all():
        _fail(name, form, "non-finite values")
    err = (got - want).abs()
    bound = atol + rtol * want.abs()
    if (err > bound).any():
        _fail(name, form, f"max abs error {float(err.max()):.3g} (tolerance {atol:g} + {rtol:g}·|ref|)")
    return float(err.max()) if err.numel() else 0.0


def _inputs(b, hq, hkv, n, m, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, m, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, m, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _padding(b: int, m: int, causal: bool) -> torch.Tensor:
    mask = torch.ones(b, m, dtype=torch.bool)
    if causal:  # left padding, as batched generation produces
        mask[0, :3] = False
    else:
        mask[0, -2:] = False
        mask[-1, 1] = False
    return mask


def check_kernel(kernel: str | type[Kernel], params: dict[str, Any] | None = None, *, atol: float = 1e-6,
                 rtol: float = 1e-5, seed: int = 0) -> dict[str, float]:
    """Check a kernel (a registered name, or a class, registered or not) with ``params`` against the brute force
    of its own definition in every form (module docstring); returns the largest error per form, raises
    AssertionError naming the first failing form."""
    cls = kernel_class(kernel) if isinstance(kernel, str) else kernel
    if not (isinstance(cls, type) and issubclass(cls, Kernel)):
        raise ValueError(f"check_kernel takes a kernel name or a Kernel subclass, got {kernel!r}")
    name = cls.name
    params = {**cls.conformance_params, **(params or {})}
    option_names = {f.name for f in dataclasses.fields(cls.options_cls)}
    if "chunk_size" in option_names:
        params.setdefault("chunk_size", CHUNK)
    modes = [c for c, ok in ((True, cls.supports_causal), (False, cls.supports_bidirectional)) if ok]
    errors: dict[str, float] = {}
    for variant in _variants(cls, params):
        for layer, (hq, hkv, d) in enumerate(SHAPES):
            shape = LayerShape(hq, hkv, d, layer_idx=layer, max_positions=64)
            kern = _build(cls, shape, variant).eval()
            kern64 = copy.deepcopy(kern).double()
            where = f"{_tag(kern.options)}Hq={hq} Hkv={hkv} D={d}"
            layer_check = CheckedLayer(name, hq, hkv, d, seed, atol, rtol, where)
            causal_only = bool(getattr(kern.options, "sparse_cache", 0))  # the cache refuses bidirectional calls
            if causal_only and False in modes:
                _check_refused(layer_check, kern64, errors)
            for causal in (c for c in modes if c or not causal_only):
                mode = _mode(causal)
                for n in (7, 8, 9, 17):
                    for padded in (False, True):
                        form = f"{mode} {where} N={n}{' key padding' if padded else ''}"
                        q, k, v = _inputs(2, hq, hkv, n, n, d, seed + n)
                        mask = _padding(2, n, causal) if padded else None
                        want = brute_force(kern64, q, k, v, mask, causal)
                        rows = _rows(2, n, n, causal, mask)
                        with torch.no_grad():  # the no-grad fast paths
                            got = kern64(q, k, v, key_mask=mask, causal=causal)
                        errors[form] = _compare(name, form, got, want, rows, atol, rtol)
                _check_gradients(layer_check, kern64, causal, errors)
                _check_low_precision(layer_check, kern, causal, errors)
            if True in modes:
                _check_decoding(layer_check, kern64, errors)
                _check_packed_decoding(layer_check, kern64, errors)
    return errors


def _variants(cls: type[Kernel], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The option sets checked: ``params``; for a feature-map kernel without a window also its ``window=5`` hybrid,
    and for one whose sinks or sparse cache a 17-token sequence would not reach, the same features at kit size
    (:data:`KIT_HYBRID`: each value at most that, so that sinks leave the window and cached pairs are chosen)."""
    variants = [dict(params)]
    if not cls.is_linear:
        return variants
    opts = make_options(cls.options_cls, cls.name, params)
    if not getattr(opts, "window", 0):
        variants.append({**params, "window": WINDOW})
    elif getattr(opts, "sinks", 0) or getattr(opts, "sparse_cache", 0):
        on = {"window": True, "sinks": opts.sinks, "sparse_cache": opts.sparse_cache,
              "sparse_block": opts.sparse_cache}
        small = {key: min(getattr(opts, key), size) for key, size in KIT_HYBRID.items() if on[key]}
        if any(small[key] != getattr(opts, key) for key in small):
            variants.append({**params, **small})
    return variants


def _tag(options: Any) -> str:
    """The hybrid's options as form names show them (``window=5 sinks=2 sparse_cache=3 sparse_block=4 ``)."""
    shown = [key for key in ("window", "sinks", "sparse_cache") if getattr(options, key, 0)]
    shown += ["sparse_block"] if "sparse_cache" in shown else []
    return "".join(f"{key}={getattr(options, key)} " for key in shown)


def _check_refused(layer: CheckedLayer, kern64: Kernel, errors: dict[str, float]) -> None:
    """With a sparse cache a bidirectional call raises the documented ValueError (the cache is causal only)."""
    form = f"bidirectional {layer.where} (refused: sparse_cache is causal only)"
    q, k, v = _inputs(2, layer.hq, layer.hkv, 9, 9, layer.d, layer.seed + 400)
    try:
        with torch.no_grad():
            kern64(q, k, v, causal=False)
    except ValueError as err:
        if "causal only" not in str(err):
            _fail(layer.name, form, f"ValueError without 'causal only': {err}")
        errors[form] = 0.0
        return
    _fail(layer.name, form, "no ValueError: a bidirectional call with a sparse cache must be refused")


def _mode(causal: bool) -> str:
    return "causal" if causal else "bidirectional"


def _check_gradients(layer: CheckedLayer, kern64: Kernel, causal: bool, errors: dict[str, float]) -> None:
    """The backward (autograd through the kernel's training path, with its hand-written backwards) against
    central finite differences of the forward in float64, along random directions of q, k, v and every trainable
    parameter; and against autograd through the brute force."""
    name, hq, hkv, d, seed = layer.name, layer.hq, layer.hkv, layer.d, layer.seed
    atol, rtol, where = layer.atol, layer.rtol, f"{_mode(causal)} {layer.where}"
    n = 17
    q, k, v = _inputs(2, hq, hkv, n, n, d, seed + 100)
    mask = _padding(2, n, causal)
    rows = _rows(2, n, n, causal, mask)
    g = torch.Generator().manual_seed(seed + 101)
    weight = torch.randn(2, n, hq, d, generator=g, dtype=torch.float64) * rows[:, :, None, None]
    named = [(n_, p) for n_, p in kern64.named_parameters() if p.requires_grad]
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = kern64(*leaves, key_mask=mask, causal=causal)
    grads = torch.autograd.grad((out * weight).sum(), [*leaves, *(p for _, p in named)], allow_unused=True)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = brute_force(kern64, *ref_leaves, mask, causal)
    ref_grads = torch.autograd.grad((ref * weight).sum(), [*ref_leaves, *(p for _, p in named)], allow_unused=True)

    def loss() -> float:  # the same (training) path as the backward's forward: inputs that require grad
        inputs = [x.detach().requires_grad_(True) for x in (q, k, v)]
        return float((kern64(*inputs, key_mask=mask, causal=causal) * weight).sum())

    targets = [("dq", q), ("dk", k), ("dv", v), *((f"d{n_}", p.data) for n_, p in named)]
    # kernels that compute in fp32 even for fp64 inputs (gaussian) get a larger step and tolerance
    exact = float((out.detach() - ref.detach())[rows].abs().max()) < 1e-10
    eps, tol = (1e-4, 1e-4) if exact else (3e-2, 2e-2)
    for (label, tensor), grad, ref_grad in zip(targets, grads, ref_grads, strict=True):
        grad = torch.zeros_like(tensor) if grad is None else grad.detach()
        ref_grad = torch.zeros_like(tensor) if ref_grad is None else ref_grad.detach()
        form = f"gradients {where} {label}"
        scale = max(1.0, float(ref_grad.abs().max()))
        errors[form] = _compare(name, form + " (autograd of the brute force)", grad, ref_grad, None,
                                atol * scale * 10, rtol * 10)
        for _ in range(2):
            u = torch.randn(tensor.shape, generator=g, dtype=torch.float64)
            with torch.no_grad():
                tensor.add_(eps * u)
                up = loss()
                tensor.sub_(2 * eps * u)
                down = loss()
                tensor.add_(eps * u)
            numeric, analytic = (up - down) / (2 * eps), float((grad * u).sum())
            if abs(numeric - analytic) > tol * (1 + abs(numeric)):
                _fail(name, form + " (finite differences)", f"directional derivative {analytic:.8g} from the "
                      f"backward, {numeric:.8g} from central differences")


def _check_decoding(layer: CheckedLayer, kern64: Kernel, errors: dict[str, float]) -> None:
    """Prefill 9 tokens, then 3 at once, then one at a time to 17: each piece's outputs = the full forward's rows
    (left padding in row 0 spans the first piece)."""
    name, hq, hkv, d, seed, where = layer.name, layer.hq, layer.hkv, layer.d, layer.seed, layer.where
    n = 17
    q, k, v = _inputs(2, hq, hkv, n, n, d, seed + 200)
    mask = _padding(2, n, True)
    rows = _rows(2, n, n, True, mask)
    want = brute_force(kern64, q, k, v, mask, True)
    pieces = [(0, 9), (9, 12), *((t, t + 1) for t in range(12, n))]
    outs = []
    stateful = kern64.is_linear
    window = getattr(kern64.options, "window", 0) if stateful else 0
    state, held = None, 0  # the state, and how many recent keys are passed again (a window hybrid's last W - 1)
    with torch.no_grad():
        for start, end in pieces:
            if stateful:  # as RecurrentStateCache drives it: the state, plus the window's keys again
                first = start - held
                out, state = kern64.forward_with_state(
                    q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], key_mask=mask[:, first:end],
                    causal=True, past=PastKeys(state, first))
                held = min(end, window - 1) if window else 0
            else:  # no recurrent state: the new queries against every key so far (N < M)
                out = kern64(q[:, :, start:end], k[:, :, :end], v[:, :, :end], key_mask=mask[:, :end], causal=True)
            outs.append(out)
    form = f"decoding {where} (pieces 9 + 3 + 1 × 5{', from the state' if stateful else ''})"
    errors[form] = _compare(name, form, torch.cat(outs, 1), want, rows, layer.atol, layer.rtol)


def _check_packed_decoding(layer: CheckedLayer, kern64: Kernel, errors: dict[str, float]) -> None:
    """For a kernel that decodes on the packed layout (``decodes_packed``), no padding: prefill 9 tokens, then one at
    a time, on the packed state as soon as ``can_pack`` allows (as the cache layer runs it) = the full forward's
    rows. Nothing is recorded where the state never packs within 17 tokens (a window longer than that)."""
    if not getattr(kern64, "decodes_packed", False):
        return
    n, ring = 17, kern64.options.window - 1
    q, k, v = _inputs(2, layer.hq, layer.hkv, n, n, layer.d, layer.seed + 500)
    want = brute_force(kern64, q, k, v, None, True)
    outs, state, packed, first_packed = [], None, None, None
    with torch.no_grad():
        for start, end in [(0, 9), *((t, t + 1) for t in range(9, n))]:
            qt, kt, vt = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            if packed is not None:
                if not kern64.fits_packed(packed, qt, kt, vt, None):
                    _fail(layer.name, f"packed decoding {layer.where}", f"the step at {start} does not fit")
                outs.append(kern64.decode_packed(qt, kt, vt, packed))
                continue
            first = max(0, start - ring) if start else 0
            out, state = kern64.forward_with_state(qt, k[:, :, first:end], v[:, :, first:end], causal=True,
                                                   past=PastKeys(state, first))
            outs.append(out)
            held = min(end, ring)
            wk, wv = (k[:, :, end - held:end], v[:, :, end - held:end]) if held else (None, None)
            if kern64.can_pack(state, wk, end):
                packed, first_packed = kern64.pack_decode_state(state, wk, wv, end), end
    if first_packed is None:
        return
    form = f"decoding {layer.where} (9 + 1 × 8, packed steps from position {first_packed})"
    errors[form] = _compare(layer.name, form, torch.cat(outs, 1), want, None, layer.atol, layer.rtol)


def _check_low_precision(layer: CheckedLayer, kern: Kernel, causal: bool, errors: dict[str, float]) -> None:
    """bf16 and fp16 q/k/v under autocast: finite, in the input dtype, near the fp32 result."""
    name, hq, hkv, d, seed = layer.name, layer.hq, layer.hkv, layer.d, layer.seed
    where = f"{_mode(causal)} {layer.where}"
    n = 17
    q, k, v = _inputs(2, hq, hkv, n, n, d, seed + 300, torch.float32)
    mask = _padding(2, n, causal)
    rows = _rows(2, n, n, causal, mask)
    with torch.no_grad():
        ref = kern(q, k, v, key_mask=mask, causal=causal)
        for dtype in (torch.bfloat16, torch.float16):
            form = f"{str(dtype).removeprefix('torch.')} autocast {where}"
            with torch.autocast("cpu", dtype=dtype):
                out = kern(q.to(dtype), k.to(dtype), v.to(dtype), key_mask=mask, causal=causal)
            if out.dtype != dtype:
                _fail(name, form, f"output dtype {out.dtype}, expected the inputs' {dtype}")
            tol = 8 * 2.0 ** -(8 if dtype == torch.bfloat16 else 11) * math.sqrt(d)
            errors[form] = _compare(name, form, out, ref, rows, tol, 0.05)
