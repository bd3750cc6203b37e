"""KernelAttentionConfig: which kernel each attention layer runs, with its parameters.

Stored as a JSON dict in ``model.config.kernel_attention`` so that ``save_pretrained`` persists it:

    {"kernel": "hedgehog", "params": {"feature_dim": 64}, "layers": {"0": "softmax", "29": "softmax"}}

``layers`` maps a layer index (the order of attention modules in the model) to another kernel name,
or to ``{"kernel": name, "params": {...}}``; unlisted layers run ``kernel`` with ``params``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from .kernels import KERNELS, SOFTMAX, defining_module, validate_params
from .kernels.registry import KernelModuleError

CONFIG_KEY = "kernel_attention"
FORMAT_VERSION = 1


@dataclasses.dataclass
class LayerChoice:
    kernel: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class KernelAttentionConfig:
    kernel: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: dict[int, LayerChoice] = dataclasses.field(default_factory=dict)
    # how an automatic layer choice (layers="auto:K") was made: {"keep_softmax": K, "softmax_layers": [...],
    # "errors": {index: transfer error}, "calibration_tokens": n}; a record only, ``layers`` holds the choice
    auto: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def create(
        cls,
        kernel: str,
        layers: list[int] | dict[int, Any] | None = None,
        num_layers: int | None = None,
        **params: Any,
    ) -> KernelAttentionConfig:
        """``layers``: None (every layer), a list of layer indices that run ``kernel`` (the others keep
        softmax), or a dict {index: kernel name or {"kernel": ..., "params": ...}}. Negative indices
        count from the end and need ``num_layers``."""
        if not isinstance(kernel, str):
            raise ValueError(f"kernel must be a kernel name (one of {sorted(KERNELS)}), got {kernel!r}")
        overrides: dict[int, LayerChoice] = {}
        if layers is None:
            pass
        elif isinstance(layers, str):
            raise ValueError(
                f"layers={layers!r}: an automatic choice ('auto:K') is made by patch(), from_pretrained() or the "
                "training config, which run the model on calibration text; here layers must be None, a list of "
                "layer indices or a dict {index: kernel}"
            )
        elif isinstance(layers, dict):
            for idx, choice in layers.items():
                overrides[_layer_index(idx, num_layers)] = _layer_choice(choice)
        elif isinstance(layers, (list, tuple, set, range)):
            chosen = {_layer_index(i, num_layers) for i in layers}
            if num_layers is None:
                raise ValueError("a list of layers needs the model's number of layers; use patch()/from_pretrained()")
            bad = sorted(i for i in chosen if i >= num_layers)
            if bad:
                raise ValueError(f"layers={list(layers)!r}: layer index {bad} out of range: the model has {num_layers} "
                                 f"attention layers (valid indices 0..{num_layers - 1}, or -{num_layers}..-1)")
            overrides = {i: LayerChoice(SOFTMAX) for i in range(num_layers) if i not in chosen}
        else:
            raise ValueError(
                f"layers must be None, a list of layer indices or a dict {{index: kernel}}, got {layers!r}"
            )
        if num_layers is not None:
            bad = [i for i in overrides if i >= num_layers]
            if bad:
                raise ValueError(f"layer index {bad} out of range: the model has {num_layers} attention layers")
        return cls(kernel=kernel, params=dict(params), layers=overrides)

    def validate(self) -> None:
        validate_params(self.kernel, self.params)
        for choice in self.layers.values():
            validate_params(choice.kernel, choice.params)

    def kernels(self) -> set[str]:
        """Every kernel name this config uses."""
        return {self.kernel, *(c.kernel for c in self.layers.values())}

    def for_layer(self, idx: int) -> LayerChoice:
        return self.layers.get(idx, LayerChoice(self.kernel, self.params))

    def to_dict(self) -> dict[str, Any]:
        layers = {
            str(i): (c.kernel if not c.params else {"kernel": c.kernel, "params": dict(c.params)})
            for i, c in sorted(self.layers.items())
        }
        out = {"kernel": self.kernel, "params": dict(self.params), "layers": layers, "version": FORMAT_VERSION}
        modules = {name: defining_module(name) for name in sorted(self.kernels()) if defining_module(name)}
        if modules:  # user kernels: imported again when the checkpoint loads
            out["modules"] = modules
        if self.auto is not None:
            out["auto"] = dict(self.auto)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelAttentionConfig:
        """Read ``config.kernel_attention`` (e.g. from a saved config.json); every malformed part raises a
        ValueError that starts with ``config.kernel_attention`` and names the bad value."""
        where = f"config.{CONFIG_KEY}"
        if not isinstance(data, dict) or "kernel" not in data:
            raise ValueError(f"{where} must be a dict with a 'kernel' key, got {data!r}")
        unknown = set(data) - set(_DICT_KEYS)
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown, key=str)} in {where}; valid keys: {list(_DICT_KEYS)}")
        version = data.get("version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"{where}['version'] must be an integer >= 1, got {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(f"{where} has format version {version}, written by a newer hf_kernel_attn; this one "
                             f"reads versions up to {FORMAT_VERSION} (upgrade hf_kernel_attn)")
        modules = data.get("modules")
        if modules is not None and (not isinstance(modules, dict)
                                    or not all(isinstance(k, str) and isinstance(v, str) for k, v in modules.items())):
            raise ValueError(f"{where}['modules'] must map kernel names to module names, got {modules!r}")
        _check_registered(data, modules or {}, where)
        kernel = data["kernel"]
        if not isinstance(kernel, str) or kernel not in KERNELS:
            raise ValueError(f"{where}['kernel']: unknown kernel {kernel!r}; available kernels: {sorted(KERNELS)}")
        params = data.get("params")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{where}['params'] must be a mapping of kernel options, got {params!r}")
        raw_layers = data.get("layers")
        if raw_layers is not None and not isinstance(raw_layers, dict):
            raise ValueError(f"{where}['layers'] must be a mapping {{index: kernel}}, got {raw_layers!r}")
        auto = data.get("auto")
        if auto is not None and not isinstance(auto, dict):
            raise ValueError(f"{where}['auto'] must be a mapping (the record of an automatic layer choice), "
                             f"got {auto!r}")
        try:
            layers = {_layer_index(i, None): _layer_choice(c) for i, c in (raw_layers or {}).items()}
            return cls(kernel=kernel, params=dict(params or {}), layers=layers, auto=auto)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


_DICT_KEYS = ("kernel", "params", "layers", "version", "auto", "modules")


def _named_kernels(data: dict[str, Any]) -> list[str]:
    """The kernel names a saved ``kernel_attention`` dict uses (the top kernel and every layer's)."""
    names = [data.get("kernel")]
    layers = data.get("layers")
    for choice in (layers.values() if isinstance(layers, dict) else ()):
        names.append(choice.get("kernel") if isinstance(choice, dict) else choice)
    return [n for n in names if isinstance(n, str)]


def _check_registered(data: dict[str, Any], modules: dict[str, str], where: str) -> None:
    """A kernel of the checkpoint that is not registered, but whose module the checkpoint names, raises a
    :class:`KernelModuleError` saying how to allow that module: reading a config never imports anything, since
    a module named by a downloaded file would run without the user's consent."""
    missing = sorted({n for n in _named_kernels(data) if n not in KERNELS and n in modules})
    if not missing:
        return
    stale = sorted(n for n in missing if modules[n] in sys.modules)
    if stale:
        raise KernelModuleError(
            f"{where}: kernel(s) {stale} of this checkpoint are not registered, though the module(s) the checkpoint "
            f"names for them, {sorted({modules[n] for n in stale})}, are imported: the module does not define the "
            f"kernel (registered kernels: {sorted(KERNELS)}); import the module that does")
    wanted = sorted({modules[n] for n in missing})
    shown = ", ".join(f"{n!r} (module {modules[n]!r})" for n in missing)
    first = wanted[0]
    raise KernelModuleError(
        f"{where}: this checkpoint's kernel {shown} is not registered, and hf_kernel_attn never imports a module "
        f"because a checkpoint names it (that would run code from a downloaded file without your consent). "
        f"If you trust {'it' if len(wanted) == 1 else 'them'}, import {wanted} first: `import {first}` in "
        f"Python, hf_kernel_attn.from_pretrained(..., kernel_modules={wanted!r}), `--import {first}` on the "
        f"command line, or `imports: {wanted}` in a training or leaderboard config. A module shipped inside the "
        "checkpoint folder also needs trust_remote_code=True (--trust-remote-code); see docs/security.md")


def _layer_index(idx: Any, num_layers: int | None) -> int:
    """An int, or a string of one (JSON object keys); floats and bools are refused, not rounded."""
    i: int | None = None
    if isinstance(idx, int) and not isinstance(idx, bool):
        i = idx
    elif isinstance(idx, str) and idx.strip().lstrip("-").isdigit():
        i = int(idx)
    if i is None:
        raise ValueError(f"layer index must be an integer, got {idx!r}")
    if i < 0:
        if num_layers is None:
            raise ValueError(f"negative layer index {i} needs the model's number of layers")
        if i < -num_layers:
            raise ValueError(f"layer index {i} out of range: the model has {num_layers} attention layers")
        i += num_layers
    return i


def _layer_choice(choice: Any) -> LayerChoice:
    if isinstance(choice, LayerChoice):
        return choice
    if isinstance(choice, str):
        return LayerChoice(choice)
    if isinstance(choice, dict) and "kernel" in choice and set(choice) <= {"kernel", "params"}:
        if choice.get("params") is not None and not isinstance(choice["params"], dict):
            raise ValueError(f"a layer's params must be a mapping of kernel options, got {choice['params']!r}")
        return LayerChoice(choice["kernel"], dict(choice.get("params") or {}))
    raise ValueError(f"a layer's choice must be a kernel name or {{'kernel': name, 'params': {{...}}}}, got {choice!r}")
