"""The kernel contract shared by every attention kernel.

A kernel is an ``nn.Module`` built once per attention layer. It receives

* ``q`` ``[B, Hq, N, D]`` and ``k``/``v`` ``[B, Hkv, M, D]`` / ``[B, Hkv, M, Dv]`` (GQA: query head ``h``
  reads KV head ``h // (Hq // Hkv)``; K/V are never repeated),
* ``key_mask`` ``[B, M]`` bool (True = real token) or ``None``,
* ``causal``: bottom-right aligned when ``N < M`` (query ``i`` sees key ``j`` iff ``j <= i + M - N``),
* ``scaling``: the softmax scale the host model would use (usually ``D ** -0.5``),

and returns ``[B, N, Hq, Dv]`` in q's dtype. Nothing here imports transformers.

Mixed precision: every kernel except softmax computes in fp32 (fp64 inputs stay fp64) with autocast switched
off inside ``forward`` and ``forward_with_state`` (wrapped once per class by :meth:`Kernel.__init_subclass__`),
so a bf16/fp16 autocast region or half-precision weights feed the kernel half-precision q/k/v and get a
half-precision output, while scores, key norms, feature maps and running states stay fp32. Softmax keeps the
host's behaviour (SDPA under autocast), so it is bit for bit the model's own attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn


class KernelOptions:
    """Base for each kernel's options dataclass: validated keyword parameters."""

    def validate(self) -> None:  # overridden where a field has a constraint
        pass


# Bounds of the options that size memory or work. A count of tokens (a window, sinks, a cache's slots, a chunk) is
# at most the model's context ceiling (:func:`token_ceiling`): the longer of its max_position_embeddings and
# TOKEN_FLOOR (bounded caches exist to run past the trained length), never more than MAX_TOKENS; a feature count is
# at most FEATURES_PER_DIM x head_dim. A checkpoint's config.json is a downloaded file: these checks run when it is
# read and when each layer's kernel is built, before any tensor is allocated. FEATURE_FLOOR keeps small heads usable
# with many features (a random-feature map approximates better with more).
MAX_TOKENS = 2**20
TOKEN_FLOOR = 2**15
FEATURES_PER_DIM = 32
FEATURE_FLOOR = 4096
MAX_FEATURES = 2**16
# eps-like floors (of a normaliser, a norm, row sums): positive, finite, and far below what they floor
EPS_RANGE = (1e-30, 1e-2)


def option(default: Any = dataclasses.MISSING, help: str = "", *,
           default_factory: Any = dataclasses.MISSING, bound: str | None = None) -> Any:
    """A field of an options dataclass with its one-line ``help`` (``metadata={"help": ...}``), which
    ``hf-kernel-attn list KERNEL`` and ``available_kernels()`` show. ``bound``: ``"tokens"`` for a count of
    tokens (checked against the model's :func:`token_ceiling` when the layer's kernel is built), ``"features"``
    for a feature count (:func:`feature_ceiling`)."""
    if bound not in (None, "tokens", "features"):
        raise ValueError(f"bound must be None, 'tokens' or 'features', got {bound!r}")
    metadata = {"help": help} if bound is None else {"help": help, "bound": bound}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def positive(name: str, value: float | int | None, *, allow_none: bool = True, high: float = 1e6) -> None:
    """Raise a ValueError unless ``value`` is a finite number in (0, high] (or None when allowed)."""
    if value is None and allow_none:
        return
    number_in(name, value, 0.0, high, low_open=True)


def number_in(name: str, value: Any, low: float, high: float, *, low_open: bool = False, meaning: str = "") -> None:
    """Raise a ValueError unless ``value`` is a finite real number with low <= value <= high (low < value with
    ``low_open``), naming the option, the value and the range."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        lo = "(" if low_open else "["
        why = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be a finite number in {lo}{low:g}, {high:g}]{why}, got {value!r}")


def integer_in(name: str, value: Any, low: int, high: int, *, meaning: str = "") -> None:
    """Raise a ValueError unless ``value`` is an integer with low <= value <= high, naming the option, the value
    and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        why = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{why}, got {value!r}")


def token_ceiling(shape: LayerShape) -> int:
    """The most tokens any option of a layer may count: max(max_position_embeddings, TOKEN_FLOOR), at most
    MAX_TOKENS."""
    return min(MAX_TOKENS, max(shape.max_positions, TOKEN_FLOOR))


def feature_ceiling(shape: LayerShape) -> int:
    """The most features a layer's map may have: max(FEATURES_PER_DIM x head_dim, FEATURE_FLOOR)."""
    return max(FEATURES_PER_DIM * shape.head_dim, FEATURE_FLOOR)


def check_bounds(kernel_name: str, shape: LayerShape, options: Any) -> None:
    """Refuse (ValueError) an option marked ``bound="tokens"`` above :func:`token_ceiling` or ``bound="features"``
    above :func:`feature_ceiling`, naming the option, its value and the allowed range."""
    for field in dataclasses.fields(options):
        bound = field.metadata.get("bound")
        value = getattr(options, field.name)
        if bound is None or value is None:
            continue
        if bound == "tokens":
            limit = token_ceiling(shape)
            why = (f"a count of tokens is at most the longer of the model's max_position_embeddings "
                   f"({shape.max_positions}) and {TOKEN_FLOOR}, never over {MAX_TOKENS}")
        else:
            limit = feature_ceiling(shape)
            why = (f"a feature count is at most the larger of {FEATURES_PER_DIM} x the layer's head_dim "
                   f"({shape.head_dim}) and {FEATURE_FLOOR}")
        if value > limit:
            raise ValueError(f"kernel {kernel_name!r} (layer {shape.layer_idx}): {field.name}={value} is too large "
                             f"for this model: the "
                             f"allowed range ends at {limit} ({why})")


def one_of(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What a kernel needs to know about the layer it is attached to."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_idx: int = 0
    max_positions: int = 2048


def make_options(options_cls: type, kernel_name: str, params: dict[str, Any]) -> KernelOptions:
    """Build and validate a kernel's options, naming the valid choices on unknown keys."""
    valid = [f.name for f in dataclasses.fields(options_cls)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for kernel {kernel_name!r}; valid options: {valid or 'none'}"
        )
    opts = options_cls(**params)
    opts.validate()
    return opts


def outside_autocast(method: Callable) -> Callable:
    """Run a kernel method ``(self, q, k, v, ...)`` with autocast off on q's device (no-op when it is off)."""
    if getattr(method, "_outside_autocast", False):
        return method

    @functools.wraps(method)
    def wrapper(self, q, *args, **kwargs):
        device = q.device.type
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return method(self, q, *args, **kwargs)
        return method(self, q, *args, **kwargs)

    wrapper._outside_autocast = True
    return wrapper


class Kernel(nn.Module):
    """Base class: one instance per attention layer, holding any learnable or fixed parameters.

    ``full_precision`` (default True): ``forward`` / ``forward_with_state`` run outside autocast, in fp32."""

    name: ClassVar[str]
    options_cls: ClassVar[type] = KernelOptions
    supports_causal: ClassVar[bool] = True
    supports_bidirectional: ClassVar[bool] = True
    is_linear: ClassVar[bool] = False
    # what the kernel is, for listings and benchmarks: "softmax-like" (an N x M score matrix), "linear" (feature
    # maps), "gated" (feature maps with a data-dependent decay), "delta" (a memory written by the delta rule) or
    # "nystrom" (landmarks)
    kind: ClassVar[str] = "softmax-like"
    # forward takes ``bias``: an additive logit bias [B or 1, Hq, N, M] (T5's relative position bias)
    supports_bias: ClassVar[bool] = False
    full_precision: ClassVar[bool] = True
    paper: ClassVar[str] = ""
    # the option bounding token positions, if any (cosformer's ``horizon``): benchmarks raise it to their length
    horizon_option: ClassVar[str | None] = None
    # options hf_kernel_attn.testing.check_kernel uses unless told otherwise (an approximation checks its exact form)
    conformance_params: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.full_precision:
            for method in ("forward", "forward_with_state"):
                if method in cls.__dict__:
                    setattr(cls, method, outside_autocast(cls.__dict__[method]))

    def __init__(self, shape: LayerShape, options: KernelOptions) -> None:
        super().__init__()
        check_bounds(getattr(self, "name", type(self).__name__), shape, options)
        self.shape = shape
        self.options = options

    def reset_parameters(self) -> None:
        """(Re)initialise learnable parameters and fixed buffers; deterministic per layer."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_mask: torch.Tensor | None = None,
        causal: bool = True,
        scaling: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        raise NotImplementedError

    def projection_width(self, backward: bool = False) -> int:
        """Columns of a learned or fixed projection applied to q and k before scoring (benchmark FLOPs)."""
        return 0

    def score_dim(self, head_dim: int) -> int:
        """Coordinates of one q·k product of a softmax-like kernel (gaussian: D + 1, its norm trick)."""
        return head_dim

    def flops(self, n: int, *, batch: int, causal: bool, backward: bool) -> float | None:
        """Matmul FLOPs of one self-attention call on ``batch`` sequences of ``n`` tokens, for kernels whose cost
        the generic estimate of ``hf_kernel_attn.speed.flops.estimate_flops`` (by ``kind``) misses;
        None = use that estimate."""
        return None

    def scores(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """The kernel's definition: κ(q_i, k_j) >= 0 for every query and key head pair, ``[B, Hq, N, M]``, such
        that out_i = Σ_j κ_ij v_j / Σ_j κ_ij over the visible keys (GQA: query head h reads KV head
        h // (Hq // Hkv)). The brute-force reference of ``hf_kernel_attn.testing.check_kernel``. Define this or
        :meth:`log_scores`."""
        if type(self).log_scores is Kernel.log_scores:
            raise NotImplementedError(f"kernel {self.name!r} defines neither scores(q, k, scaling) nor log_scores")
        return self.log_scores(q, k, scaling).exp()

    def log_scores(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """log κ(q_i, k_j) ``[B, Hq, N, M]`` (see :meth:`scores`); -inf where κ = 0."""
        if type(self).scores is Kernel.scores:
            raise NotImplementedError(f"kernel {self.name!r} defines neither scores(q, k, scaling) nor log_scores")
        return self.scores(q, k, scaling).log()

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: torch.Tensor | None = None,
                  causal: bool = True, scaling: float | None = None) -> torch.Tensor:
        """The kernel's definition evaluated directly, ``[B, N, Hq, Dv]``, for a kernel whose output is not
        Σ_j κ_ij v_j / Σ_j κ_ij (a recurrence, as the delta rule's memory): where defined,
        ``hf_kernel_attn.testing.check_kernel`` uses it as the brute force instead of :meth:`scores`."""
        raise NotImplementedError

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"{self.name}: q, k, v must be 4-D [B, H, N, D]; got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{self.name}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        if causal and not self.supports_causal:
            raise ValueError(f"kernel {self.name!r} is bidirectional only and cannot run a causal (decoder) model")
        if not causal and not self.supports_bidirectional:
            raise ValueError(f"kernel {self.name!r} is causal only")

    def extra_repr(self) -> str:
        return f"layer={self.shape.layer_idx}, {self.options}"


def visibility_mask(
    key_mask: torch.Tensor | None, n: int, m: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """Bool ``[B or 1, 1, N, M]`` (True = attend), or None when everything is visible.

    Causality is bottom-right aligned. Rows with no visible key (pad queries under left padding)
    are opened to every key so that they stay finite; their outputs are never used.
    """
    mask = None
    if causal and not (n == 1):
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(m, device=device)[None, :]
        mask = (j <= i + (m - n))[None, None]
    if key_mask is not None:
        km = key_mask[:, None, None, :].to(torch.bool)
        mask = km if mask is None else mask & km
    if mask is not None:
        mask = mask | ~mask.any(-1, keepdim=True)
    return mask


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, Hkv, M, D] -> [B, Hq, M, D]``: each KV head repeated for the query heads that read it."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1) if x.shape[1] != num_heads else x


def accum(x: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype: fp32, or fp64 when the input already is (exactness checks)."""
    return x if x.dtype == torch.float64 else x.float()


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, N, D] -> [B, Hkv, G, N, D]`` (query head h = kv * G + g)."""
    b, hq, n, d = q.shape
    return q.view(b, num_kv_heads, hq // num_kv_heads, n, d)


def ungroup_output(out: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, N, Dv] -> [B, N, Hq, Dv]`` contiguous."""
    b, hkv, g, n, dv = out.shape
    return out.reshape(b, hkv * g, n, dv).transpose(1, 2).contiguous()
