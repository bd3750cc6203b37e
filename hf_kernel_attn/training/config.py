"""The conversion-training config: a YAML file, ``--set KEY=VALUE`` overrides, validation.

Every key has a type, a default and a help text in the dataclasses of :mod:`.config_fields` and
:mod:`.config_schema` (:class:`TrainingConfig`; ``hf-kernel-attn finetune --help-config`` lists them); a key that
is not in the schema is an error that names the nearest valid key. Dotted keys address nested sections
(``stages.transfer.lr``). The ``stages`` section holds every registered stage, those that the config's own
``imports:`` register too: the modules are imported first, then the defaults are built and the file and the
overrides merged into them. The trainer reads the checked config as a mapping (:meth:`TrainingConfig.to_dict`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ..configfile import (  # noqa: F401  (ConfigError and resolve_package_path: public names of the training config)
    ConfigError,
    apply_overrides,
    nearest_key,
    parse_override,
    read_yaml_file,
    resolve_package_path,
    yaml_load,
)
from ..kernels import import_modules
from .config_fields import (  # noqa: F401  (the former constants of this module)
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
    _is_int,
    stage_config_class,
)
from .config_schema import TrainingConfig, defaults, unknown_key
from .stages import stage_names

# transformers.TrainingArguments names, read as the keys they stand for
ALIASES = {"per_device_train_batch_size": "data.batch_size", "gradient_accumulation_steps": "data.grad_accum",
           "save_steps": "save_every", "save_total_limit": "keep_checkpoints", "report_to": "log_with"}
# TrainingArguments names of a stage's keys: under stages.<name>, that stage's key; at the top level, the key of
# every stage that runs (steps > 0 once the file and the other overrides are read)
STAGE_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "lr_scheduler_type": "schedule",
                 "warmup_steps": "warmup_steps", "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm"}
PRECISION_FLAGS = ("bf16", "fp16")  # bf16: true is mixed_precision: bf16


def configured_stages(config: dict[str, Any]) -> list[str]:
    """The stages a resolved config has a section for, in run order."""
    return [name for name in stage_names() if name in config["stages"]]


def __getattr__(name: str) -> Any:
    """``DEFAULTS`` (the former constant): :func:`defaults` computed at the access, so it holds the stages
    registered by then."""
    if name == "DEFAULTS":
        return defaults()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _translate(update: dict[str, Any], prefix: str, every_stage: dict[str, Any]) -> dict[str, Any]:
    """``update`` with TrainingArguments names replaced by the keys they stand for; top-level stage names are
    collected in ``every_stage`` (applied to the running stages at the end)."""
    out: dict[str, Any] = {}
    for key, value in update.items():
        if prefix == "" and key in ALIASES:
            path = ALIASES[key].split(".")
            target = out
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = value
        elif prefix == "" and key in PRECISION_FLAGS:
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
            if value:
                out["mixed_precision"] = key
        elif prefix == "" and key in STAGE_ALIASES:
            every_stage[STAGE_ALIASES[key]] = value
        elif prefix.startswith("stages.") and prefix.count(".") == 2 and key in STAGE_ALIASES:
            out[STAGE_ALIASES[key]] = value
        else:
            out[key] = value
    return out


def _merge(base: dict[str, Any], update: dict[str, Any], prefix: str = "",
           every_stage: dict[str, Any] | None = None) -> None:
    update = _translate(update, prefix, every_stage if every_stage is not None else {})
    for key, value in update.items():
        full = f"{prefix}{key}"
        if key not in base:
            raise unknown_key(full)
        if key in OPEN_KEYS and isinstance(base[key], dict) and isinstance(value, dict):
            base[key] = {**base[key], **value}  # --set kernel_params.x=1 adds to the file's options
        elif isinstance(base[key], dict) and key not in OPEN_KEYS:
            if not isinstance(value, dict):
                raise ConfigError(f"config key {full!r} is a section; give a mapping, got {value!r}")
            _merge(base[key], value, f"{full}.", every_stage)
        else:
            base[key] = value


def _canonical(tree: dict[str, Any], prefix: str, every_stage: dict[str, Any]) -> dict[str, Any]:
    """``tree`` (the file's mapping, or a section of it) with the TrainingArguments names replaced by the keys they
    stand for, in every section (so that a later ``--set`` of the real key replaces the file's alias)."""
    out = _translate(tree, prefix, every_stage)
    for key, value in out.items():
        if isinstance(value, dict) and (prefix == "" and key in ("data", "stages") or prefix == "stages."):
            out[key] = _canonical(value, f"{prefix}{key}.", every_stage)
    return out


def _canonical_override(item: str, every_stage: dict[str, Any]) -> list[str]:
    """A ``--set`` item with a TrainingArguments name replaced by the key it stands for: ``bf16=true`` is
    ``mixed_precision=bf16``, a top-level stage name (``learning_rate=...``) goes to ``every_stage``."""
    path, value = parse_override(item)
    raw = item.split("=", 1)[1]
    if len(path) == 1 and path[0] in STAGE_ALIASES:
        every_stage[STAGE_ALIASES[path[0]]] = value
        return []
    if len(path) == 1 and path[0] in PRECISION_FLAGS:
        return [f"{key}={flag}" for key, flag in _translate({path[0]: value}, "", every_stage).items()]
    if path[0] in ALIASES:
        path = [*ALIASES[path[0]].split("."), *path[1:]]
    elif len(path) >= 3 and path[0] == "stages" and path[2] in STAGE_ALIASES:
        path[2] = STAGE_ALIASES[path[2]]
    return [f"{'.'.join(path)}={raw}"]


def _merge_keys(file: dict[str, Any]) -> set[str]:
    """The keys whose mapping value a ``--set`` merges into the file's (:func:`apply_overrides`): the free-form
    mappings (``kernel_params={eps: 1e-9}`` adds an option) and the sections (``data={seq_len: 8}`` keeps
    ``data.train``)."""
    stages = file.get("stages")
    names = {*stage_names(), *(stages if isinstance(stages, dict) else ())}
    return {*OPEN_KEYS, "data", "stages", *(f"stages.{name}" for name in names)}


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None,
                base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Defaults <- YAML file <- ``--set`` overrides, validated. The ``imports:`` modules (the file's, or an
    override's) are imported first, so that the kernels, tasks and stages they register are known to the
    defaults and the checks. Relative local paths in the file are resolved against the current directory
    (where the command runs)."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        data = read_yaml_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a YAML mapping, got {type(data).__name__}")
    every_stage: dict[str, Any] = {}
    data = _canonical(data, "", every_stage)
    sets = [line for item in overrides or [] for line in _canonical_override(item, every_stage)]
    imports = apply_overrides(data, sets).get("imports", [])
    _check(isinstance(imports, list) and all(isinstance(m, str) for m in imports),
           f"imports must be a list of module names, got {imports!r}")
    try:
        import_modules(imports, where="imports")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = defaults()
    _merge(config, apply_overrides(data, sets, merge=_merge_keys(data)), every_stage=every_stage)
    running = [s for s in configured_stages(config) if _is_int(config["stages"][s]["steps"], 1)]
    for key, value in every_stage.items():
        for name in running:
            config["stages"][name][key] = value
    if isinstance(config["model"], str) and config["model"].startswith("pkg:"):
        config["model"] = resolve_package_path(config["model"])
    validate(config)
    return config


def validate(config: dict[str, Any]) -> TrainingConfig:
    """Check every key's type and range that the config alone decides: the :class:`TrainingConfig` it holds
    (raises :class:`ConfigError`). ``config`` takes the normalised values (``mixed_precision: false`` is ``no``,
    ``inference_layers``' ``--set`` indices are integers). What depends on the model -- layer indices against its
    layer count, kernel options against each layer's heads and size -- is checked when the run loads it, before
    anything is written (:func:`.model_setup.check_against_model`)."""
    checked = TrainingConfig.from_dict(config)
    config.update(checked.to_dict())
    return checked


def dump_config(config: dict[str, Any], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
