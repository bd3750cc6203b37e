""":class:`TrainingConfig`: the whole conversion-training config, checked on construction; the defaults and the
valid keys come from its fields (:mod:`.config_fields`)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import KernelAttentionConfig
from ..configfile import ConfigError
from ..integration.layer_choice import parse_auto, parse_heads
from ..kernels import KERNELS, validate_params
from .config_fields import (
    BUDGET_CLOCKS,
    MIXED_PRECISION,
    OPEN_KEYS,
    REQUIRED,
    BudgetConfig,
    DataConfig,
    KernelConfig,
    ModelConfig,
    OutputConfig,
    StageConfig,
    _check,
    _help,
    _is_int,
    field_defaults,
    stage_config_class,
)
from .sharding import SHARDINGS
from .stages import STAGE_TYPES, stage_names
from .tasks import TASK_TYPES


def defaults() -> dict[str, Any]:
    """A fresh copy of every key's default; ``stages`` holds each stage registered now, in run order."""
    config = field_defaults(TrainingConfig)
    config["data"] = field_defaults(DataConfig)
    config["stages"] = {name: field_defaults(stage_config_class(name)) for name in stage_names()}
    return config


def all_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of a config tree (the free-form mappings' own keys left out)."""
    keys = []
    for key, value in tree.items():
        full = f"{prefix}{key}"
        keys.append(full)
        if isinstance(value, dict) and key not in OPEN_KEYS:
            keys += all_keys(value, f"{full}.")
    return keys


def unknown_key(key: str) -> ConfigError:
    """The error for a key that is not in the schema: it names the nearest valid key (or lists them)."""
    valid = all_keys(defaults())
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # compare the last component too (a misspelled leaf under the right section)
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in valid if k.startswith(key.rsplit(".", 1)[0])}
        match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
        close = [leaves[match[0]]] if match else []
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(valid)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def check_keys(tree: Mapping[str, Any], schema: Mapping[str, Any], prefix: str = "") -> None:
    """Every key of ``tree`` is one of ``schema``'s (the defaults), and every section is a mapping."""
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if key not in schema:
            raise unknown_key(full)
        if isinstance(schema[key], dict) and key not in OPEN_KEYS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key {full!r} is a section; give a mapping, got {value!r}")
            check_keys(value, schema[key], f"{full}.")


def _plain(value: Any) -> Any:
    """A section as a plain mapping (a dataclass's fields, or a copy of the mapping)."""
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return dict(value)


@dataclass
class TrainingConfig(OutputConfig, BudgetConfig, KernelConfig, ModelConfig):
    """The config of ``hf-kernel-attn finetune``: :class:`ModelConfig`, :class:`KernelConfig`,
    :class:`BudgetConfig` and :class:`OutputConfig` keys at the top level, and the ``data`` and ``stages``
    sections. A mapping given for a section is read as its dataclass, keys missing from it take their defaults.
    Raises :class:`ConfigError` (naming the key) on the first value that cannot be used."""

    data: DataConfig = _help("the training data (a mapping is read as `DataConfig`)", default_factory=dict)
    stages: dict[str, StageConfig] = _help("each registered stage's keys, in run order", default_factory=dict)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> TrainingConfig:
        """The config a mapping of YAML keys holds (TrainingArguments names already translated): unknown keys
        are errors naming the nearest valid key."""
        check_keys(config, defaults())
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        """The config as the mapping the trainer reads (and ``config.resolved.yaml`` saves)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["data"] = _plain(self.data)
        out["stages"] = {name: _plain(stage) for name, stage in self.stages.items()}
        return out

    def __post_init__(self) -> None:
        if not isinstance(self.data, DataConfig):
            self.data = {**field_defaults(DataConfig), **self.data}  # type: ignore[assignment]
        given = dict(self.stages)
        for name in given:
            if name not in STAGE_TYPES:
                raise unknown_key(f"stages.{name}")
        self.stages = {name: given.get(name, {}) for name in stage_names()}
        for name, stage in self.stages.items():
            if not isinstance(stage, StageConfig):
                self.stages[name] = {**field_defaults(stage_config_class(name)), **stage}  # type: ignore[assignment]
        self._check_model()
        self._check_kernel()
        self._check_layer_options()
        if not isinstance(self.data, DataConfig):
            self.data = DataConfig(**self.data)
        _check(not self.data.recall_fraction or TASK_TYPES[self.task].language_model,
               f"data.recall_fraction adds recall facts to language-modelling text: it needs task causal_lm, got "
               f"{self.task!r}")
        self._check_run()
        for name, stage in self.stages.items():
            if not isinstance(stage, StageConfig):
                self.stages[name] = stage_config_class(name)(**stage)
        view = self.to_dict()
        for name in self.stages:
            problem = STAGE_TYPES[name].check_config(view["stages"][name], view)
            _check(problem is None, problem or "")
        _check(any(stage.steps for stage in self.stages.values()),
               f"every stage has steps: 0; nothing to train (set stages.<{'|'.join(self.stages)}>.steps)")

    def _check_model(self) -> None:
        for key in REQUIRED:
            _check(getattr(self, key) not in (None, ""), f"config key {key!r} is required")
        _check(self.task in TASK_TYPES, f"task must be one of {sorted(TASK_TYPES)}, got {self.task!r}")
        problem = TASK_TYPES[self.task].check_config(self.to_dict())
        _check(problem is None, problem or "")

    def _check_kernel(self) -> None:
        kernel = self.kernel
        _check(isinstance(kernel, str) and kernel in KERNELS,
               f"unknown kernel {kernel!r}; available: {sorted(KERNELS)}")
        _check(isinstance(self.config_overrides, dict),
               f"config_overrides must be a mapping of model config attributes, got {self.config_overrides!r}")
        _check(isinstance(self.kernel_params, dict),
               f"kernel_params must be a mapping of kernel options, got {self.kernel_params!r}")
        layers = self.layers
        _check(layers is None or isinstance(layers, (list, dict, str)),
               f"layers must be null, a list of layer indices, a mapping {{index: kernel}} or 'auto:K', got {layers!r}")
        try:
            if isinstance(layers, str):
                parse_auto(layers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if isinstance(layers, list):
            bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int)]
            _check(not bad, f"layers: layer indices must be integers, got {bad!r} in {layers!r}")
        elif isinstance(layers, dict):  # keys and kernels; the range is checked against the model when it loads
            try:
                KernelAttentionConfig.create(kernel, layers, num_layers=1 << 30)
            except ValueError as exc:
                raise ConfigError(f"layers: {exc}") from None
        if self.heads is not None:
            try:
                criterion, _ = parse_heads(self.heads)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            _check(KERNELS[kernel].is_linear,
                   f"heads: {self.heads!r} keeps some heads of feature-map layers exact; kernel {kernel!r} is not a "
                   f"feature-map kernel (one of {sorted(n for n, c in KERNELS.items() if c.is_linear)})")
            _check(criterion != "retrieval" or TASK_TYPES[self.task].language_model,
                   f"heads: {self.heads!r} scores heads on recall facts answered by a causal LM; task {self.task!r} "
                   "can use 'auto:K' (transfer error)")
        _check(isinstance(self.heads_share_kv, bool), f"heads_share_kv must be true or false, got "
               f"{self.heads_share_kv!r}")

    def _check_layer_options(self) -> None:
        """``kernel_params``, ``inference_params`` and ``inference_layers`` against the kernel's options; a
        ``--set`` override's layer index (a string of digits) becomes an integer."""
        kernel = self.kernel
        try:
            validate_params(kernel, self.kernel_params)
        except ValueError as exc:
            raise ConfigError(f"kernel_params: {exc}") from None
        _check(isinstance(self.inference_params, dict),
               f"inference_params must be a mapping of kernel options, got {self.inference_params!r}")
        try:
            validate_params(kernel, {**self.kernel_params, **self.inference_params})
        except ValueError as exc:
            raise ConfigError(f"inference_params: {exc}") from None
        layer_options = self.inference_layers
        _check(isinstance(layer_options, dict), "inference_layers must be a mapping {layer index: kernel options}, "
               f"got {layer_options!r}")
        for idx, options in list(layer_options.items()):
            if isinstance(idx, str) and idx.isdigit():  # a --set override's key
                layer_options[int(idx)] = layer_options.pop(idx)
                idx = int(idx)
            # below the model's layer count: checked when it loads
            _check(_is_int(idx, 0), f"inference_layers: keys are layer indices (integers >= 0), got {idx!r}")
            _check(isinstance(options, dict), f"inference_layers.{idx} must be a mapping of kernel options, got "
                   f"{options!r}")
            try:
                validate_params(kernel, {**self.kernel_params, **self.inference_params, **options})
            except ValueError as exc:
                raise ConfigError(f"inference_layers.{idx}: {exc}") from None

    def _check_run(self) -> None:
        """The :class:`BudgetConfig` and :class:`OutputConfig` keys."""
        if self.mixed_precision is False:  # YAML 1.1 reads an unquoted `no` as false
            self.mixed_precision = "no"
        _check(self.mixed_precision in (None, *MIXED_PRECISION),
               f"mixed_precision must be one of {list(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        _check(isinstance(self.gradient_checkpointing, bool),
               f"gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")
        _check(self.sharding in SHARDINGS, f"sharding must be one of {list(SHARDINGS)}, got {self.sharding!r}")
        full = self.stages["full"]
        _check(self.sharding == "none" or (full.steps if isinstance(full, StageConfig) else full["steps"]) > 0,
               "sharding: fsdp shards the full stage (full fine-tuning); set stages.full.steps, or sharding: none "
               "(transfer and LoRA train few weights: every process keeps a replica)")
        for key in ("push_to_hub", "hub_private_repo"):
            _check(isinstance(getattr(self, key), bool), f"{key} must be true or false, got {getattr(self, key)!r}")
        hub_id = self.hub_model_id
        _check(hub_id is None or (isinstance(hub_id, str) and 0 < hub_id.count("/") + 1 <= 2
                                  and all(hub_id.split("/"))),
               f"hub_model_id must be 'owner/name' or 'name', got {hub_id!r}")
        _check(self.budget_clock in BUDGET_CLOCKS,
               f"budget_clock must be one of {list(BUDGET_CLOCKS)}, got {self.budget_clock!r}")
        _check(_is_int(self.seed), f"seed must be an integer >= 0, got {self.seed!r}")
        _check(_is_int(self.save_every), f"save_every must be an integer >= 0, got {self.save_every!r}")
        _check(_is_int(self.keep_checkpoints, 1), "keep_checkpoints must be an integer >= 1")
