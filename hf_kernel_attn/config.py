"""KernelAttentionConfig: which kernel each attention layer runs, with its parameters.

Stored as a JSON dict in ``model.config.kernel_attention`` so that ``save_pretrained`` persists it:

    {"kernel": "hedgehog", "params": {"feature_dim": 64}, "layers": {"0": "softmax", "29": "softmax"}}

``layers`` maps a layer index (the order of attention modules in the model) to another kernel name,
or to ``{"kernel": name, "params": {...}}``; unlisted layers run ``kernel`` with ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .kernels import KERNELS, validate_params

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
        elif isinstance(layers, dict):
            for idx, choice in layers.items():
                overrides[_layer_index(idx, num_layers)] = _layer_choice(choice)
        elif isinstance(layers, (list, tuple, set, range)):
            chosen = {_layer_index(i, num_layers) for i in layers}
            if num_layers is None:
                raise ValueError("a list of layers needs the model's number of layers; use patch()/from_pretrained()")
            overrides = {i: LayerChoice("softmax") for i in range(num_layers) if i not in chosen}
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

    def for_layer(self, idx: int) -> LayerChoice:
        return self.layers.get(idx, LayerChoice(self.kernel, self.params))

    def to_dict(self) -> dict[str, Any]:
        layers = {
            str(i): (c.kernel if not c.params else {"kernel": c.kernel, "params": dict(c.params)})
            for i, c in sorted(self.layers.items())
        }
        return {"kernel": self.kernel, "params": dict(self.params), "layers": layers, "version": FORMAT_VERSION}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelAttentionConfig:
        if not isinstance(data, dict) or "kernel" not in data:
            raise ValueError(f"config.{CONFIG_KEY} must be a dict with a 'kernel' key, got {data!r}")
        unknown = set(data) - {"kernel", "params", "layers", "version"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} in config.{CONFIG_KEY}; "
                             "valid keys: ['kernel', 'params', 'layers', 'version']")
        layers = {_layer_index(i, None): _layer_choice(c) for i, c in (data.get("layers") or {}).items()}
        return cls(kernel=data["kernel"], params=dict(data.get("params") or {}), layers=layers)


def _layer_index(idx: Any, num_layers: int | None) -> int:
    try:
        i = int(idx)
    except (TypeError, ValueError):
        raise ValueError(f"layer index must be an integer, got {idx!r}") from None
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
        return LayerChoice(choice["kernel"], dict(choice.get("params") or {}))
    raise ValueError(f"a layer's choice must be a kernel name or {{'kernel': name, 'params': {{...}}}}, got {choice!r}")
