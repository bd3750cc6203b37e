"""The conversion-training config: a YAML file, ``--set KEY=VALUE`` overrides, validation.

Every key has a default here (:func:`defaults`); a key that is not in the schema is an error that names
the nearest valid key. Dotted keys address nested sections (``stages.transfer.lr``). The ``stages`` section
holds every registered stage, those that the config's own ``imports:`` register too: the modules are imported
first, then the defaults are built and the file and the overrides merged into them.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from ..config import KernelAttentionConfig
from ..configfile import (  # noqa: F401  (ConfigError and resolve_package_path: public names of the training config)
    ConfigError,
    apply_overrides,
    nearest_key,
    parse_override,
    read_yaml_file,
    resolve_package_path,
    yaml_load,
)
from ..integration.layer_choice import parse_auto, parse_heads
from ..kernels import KERNELS, import_modules, validate_params
from .schedules import SCHEDULES
from .sharding import SHARDINGS
from .stages import COMMON_DEFAULTS, STAGE_TYPES, stage_names
from .tasks import TASK_TYPES

MIXED_PRECISION = ("no", "bf16", "fp16")
BUDGET_CLOCKS = ("wall", "cpu")

# every key but the stages' (defaults() adds those of the stages registered when it is called)
_DEFAULTS: dict[str, Any] = {
    "model": None,               # folder or hub id
    "gguf_file": None,           # convert a GGUF checkpoint on the fly
    "base_model_id": None,       # the Hub id the model card names as base_model (default: model, if a Hub id)
    "model_class": None,         # e.g. "AutoModelForSequenceClassification"; None = from task
    "config_overrides": {},      # model config attributes set on load, e.g. {hidden_dropout_prob: 0.0}
    "task": "causal_lm",
    "kernel": None,
    "kernel_params": {},
    "inference_params": {},      # kernel options added to the saved model's kernel after training (sparse_cache: C)
    "inference_layers": {},      # {layer index: kernel options} added to those layers of the saved model only
    "layers": None,              # list of layer indices, {index: kernel}, or "auto:K"; None = every layer
    "heads": None,               # "auto:K": after transfer, the K query heads furthest from softmax stay exact softmax
                                 # "retrieval:K": the K heads whose teacher attends most to a recalled fact
    "heads_share_kv": False,     # heads: K counts KV heads, each kept with all the query heads that share its cache
    "data": {
        "train": [],             # local files, or a hub dataset id (string)
        "glue_task": None,       # sst2 | mrpc | rte | cola | stsb | qnli: column layout of GLUE files
        "text_column": "text",   # hub text datasets
        "seq_len": 512,
        "batch_size": 4,         # per process and micro-batch
        "grad_accum": 1,
        "validation_fraction": 0.05,  # text: the end of each training file is held out
        "validation_batches": 8,
        "max_train_chars": None,  # per text file
        "recall_fraction": 0.0,  # causal_lm: share of training blocks carrying synthetic key-value facts
        "recall_max_facts": 3,   # facts per such block (1 ... this), each stated once and asked at the end
    },
    "seed": 0,
    "imports": [],               # modules to import first: they register kernels, tasks or stages of your own
    "stages": {},                # each registered stage's keys: COMMON_DEFAULTS and the stage's own `defaults`
    "save_every": 100,
    "keep_checkpoints": 2,
    "output_dir": None,
    "merge_lora": True,
    "validate": True,            # score the held-out slice before training and after each stage
    "threads": None,
    "budget_clock": "wall",      # max_minutes in wall-clock minutes, or cpu: process CPU time / torch threads
    "log_with": "auto",          # auto (tensorboard when installed) | none | tensorboard | wandb ...
    "mixed_precision": None,     # no | bf16 | fp16: accelerate's autocast around each training forward;
                                 # null: the launcher's (accelerate config), else no; the resolved config saves it
    "gradient_checkpointing": False,  # recompute each layer in backward (distill, lora, full)
    "sharding": "none",          # none | fsdp: the full stage sharded with FSDP2 over the processes
    "push_to_hub": False,        # upload final/ (model, tokenizer, model card) to hub_model_id when the run ends
    "hub_model_id": None,        # owner/name (or name, under your account); default: output_dir's name
    "hub_private_repo": False,
}
# transformers.TrainingArguments names, read as the keys they stand for
ALIASES = {"per_device_train_batch_size": "data.batch_size", "gradient_accumulation_steps": "data.grad_accum",
           "save_steps": "save_every", "save_total_limit": "keep_checkpoints", "report_to": "log_with"}
# TrainingArguments names of a stage's keys: under stages.<name>, that stage's key; at the top level, the key of
# every stage that runs (steps > 0 once the file and the other overrides are read)
STAGE_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "lr_scheduler_type": "schedule",
                 "warmup_steps": "warmup_steps", "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm"}
PRECISION_FLAGS = ("bf16", "fp16")  # bf16: true is mixed_precision: bf16
REQUIRED = ("model", "kernel", "output_dir")
# keys whose value is free-form (a mapping of the user's own keys)
OPEN_KEYS = {"kernel_params", "inference_params", "inference_layers", "layers", "config_overrides"}


def defaults() -> dict[str, Any]:
    """A fresh copy of every key's default; ``stages`` holds each stage registered now, in run order."""
    config = copy.deepcopy(_DEFAULTS)
    config["stages"] = {name: copy.deepcopy({**COMMON_DEFAULTS, **STAGE_TYPES[name].defaults})
                        for name in stage_names()}
    return config


def configured_stages(config: dict[str, Any]) -> list[str]:
    """The stages a resolved config has a section for, in run order."""
    return [name for name in stage_names() if name in config["stages"]]


def __getattr__(name: str) -> Any:
    """``DEFAULTS`` (the former constant): :func:`defaults` computed at the access, so it holds the stages
    registered by then."""
    if name == "DEFAULTS":
        return defaults()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _all_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        full = f"{prefix}{key}"
        keys.append(full)
        if isinstance(value, dict) and key not in OPEN_KEYS:
            keys += _all_keys(value, f"{full}.")
    return keys


def _unknown(key: str) -> ConfigError:
    valid = _all_keys(defaults())
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # compare the last component too (a misspelled leaf under the right section)
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in valid if k.startswith(key.rsplit(".", 1)[0])}
        match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
        close = [leaves[match[0]]] if match else []
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(valid)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


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
            raise _unknown(full)
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
    imports = apply_overrides(data, sets).get("imports", _DEFAULTS["imports"])
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


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_num(x: Any, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= low


def validate(config: dict[str, Any]) -> None:
    """Check every key's type and range that the config alone decides (raises :class:`ConfigError`). What depends on
    the model -- layer indices against its layer count, kernel options against each layer's heads and size -- is
    checked when the run loads it, before anything is written (:func:`.model_setup.check_against_model`)."""
    for key in REQUIRED:
        _check(config.get(key) not in (None, ""), f"config key {key!r} is required")
    _check(config["task"] in TASK_TYPES, f"task must be one of {sorted(TASK_TYPES)}, got {config['task']!r}")
    problem = TASK_TYPES[config["task"]].check_config(config)
    _check(problem is None, problem or "")

    _check(isinstance(config["kernel"], str) and config["kernel"] in KERNELS,
           f"unknown kernel {config['kernel']!r}; available: {sorted(KERNELS)}")
    _check(isinstance(config["config_overrides"], dict),
           f"config_overrides must be a mapping of model config attributes, got {config['config_overrides']!r}")
    _check(isinstance(config["kernel_params"], dict),
           f"kernel_params must be a mapping of kernel options, got {config['kernel_params']!r}")
    layers = config["layers"]
    _check(layers is None or isinstance(layers, (list, dict, str)),
           f"layers must be null, a list of layer indices, a mapping {{index: kernel}} or 'auto:K', got {layers!r}")
    if isinstance(layers, str):
        try:
            parse_auto(layers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    elif isinstance(layers, list):
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int)]
        _check(not bad, f"layers: layer indices must be integers, got {bad!r} in {layers!r}")
    elif isinstance(layers, dict):  # keys and kernels; the range is checked against the model when it loads

        try:
            KernelAttentionConfig.create(config["kernel"], layers, num_layers=1 << 30)
        except ValueError as exc:
            raise ConfigError(f"layers: {exc}") from None
    heads = config["heads"]
    if heads is not None:
        try:
            criterion, _ = parse_heads(heads)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check(KERNELS[config["kernel"]].is_linear,
               f"heads: {heads!r} keeps some heads of feature-map layers exact; kernel {config['kernel']!r} is not a "
               f"feature-map kernel (one of {sorted(n for n, c in KERNELS.items() if c.is_linear)})")
        _check(criterion != "retrieval" or TASK_TYPES[config["task"]].language_model,
               f"heads: {heads!r} scores heads on recall facts answered by a causal LM; task {config['task']!r} "
               "can use 'auto:K' (transfer error)")
    _check(isinstance(config["heads_share_kv"], bool), f"heads_share_kv must be true or false, got "
           f"{config['heads_share_kv']!r}")
    try:
        validate_params(config["kernel"], config["kernel_params"])
    except ValueError as exc:
        raise ConfigError(f"kernel_params: {exc}") from None
    _check(isinstance(config["inference_params"], dict),
           f"inference_params must be a mapping of kernel options, got {config['inference_params']!r}")
    try:
        validate_params(config["kernel"], {**config["kernel_params"], **config["inference_params"]})
    except ValueError as exc:
        raise ConfigError(f"inference_params: {exc}") from None
    layer_options = config["inference_layers"]
    _check(isinstance(layer_options, dict), "inference_layers must be a mapping {layer index: kernel options}, got "
           f"{layer_options!r}")
    for idx, options in list(layer_options.items()):
        if isinstance(idx, str) and idx.isdigit():  # a --set override's key
            layer_options[int(idx)] = layer_options.pop(idx)
            idx = int(idx)
        # below the model's layer count: checked when it loads
        _check(_is_int(idx, 0), f"inference_layers: keys are layer indices (integers >= 0), got {idx!r}")
        _check(isinstance(options, dict), f"inference_layers.{idx} must be a mapping of kernel options, got "
               f"{options!r}")
        try:
            validate_params(config["kernel"], {**config["kernel_params"], **config["inference_params"], **options})
        except ValueError as exc:
            raise ConfigError(f"inference_layers.{idx}: {exc}") from None
    data = config["data"]
    train = data["train"]
    _check(isinstance(train, (str, list)) and bool(train),
           "data.train must be a list of local files or a hub dataset id")
    for key in ("seq_len", "batch_size", "grad_accum", "validation_batches"):
        _check(_is_int(data[key], 1), f"data.{key} must be an integer >= 1, got {data[key]!r}")
    _check(_is_num(data["validation_fraction"]) and data["validation_fraction"] < 1,
           f"data.validation_fraction must be in [0, 1), got {data['validation_fraction']!r}")
    _check(_is_num(data["recall_fraction"]) and data["recall_fraction"] <= 1,
           f"data.recall_fraction must be in [0, 1], got {data['recall_fraction']!r}")
    _check(_is_int(data["recall_max_facts"], 1),
           f"data.recall_max_facts must be an integer >= 1, got {data['recall_max_facts']!r}")
    _check(not data["recall_fraction"] or TASK_TYPES[config["task"]].language_model,
           f"data.recall_fraction adds recall facts to language-modelling text: it needs task causal_lm, got "
           f"{config['task']!r}")
    if config["mixed_precision"] is False:  # YAML 1.1 reads an unquoted `no` as false
        config["mixed_precision"] = "no"
    _check(config["mixed_precision"] in (None, *MIXED_PRECISION),
           f"mixed_precision must be one of {list(MIXED_PRECISION)}, got {config['mixed_precision']!r}")
    _check(isinstance(config["gradient_checkpointing"], bool),
           f"gradient_checkpointing must be true or false, got {config['gradient_checkpointing']!r}")
    _check(config["sharding"] in SHARDINGS, f"sharding must be one of {list(SHARDINGS)}, got {config['sharding']!r}")
    _check(config["sharding"] == "none" or config["stages"]["full"]["steps"] > 0,
           "sharding: fsdp shards the full stage (full fine-tuning); set stages.full.steps, or sharding: none "
           "(transfer and LoRA train few weights: every process keeps a replica)")
    for key in ("push_to_hub", "hub_private_repo"):
        _check(isinstance(config[key], bool), f"{key} must be true or false, got {config[key]!r}")
    hub_id = config["hub_model_id"]
    _check(hub_id is None or (isinstance(hub_id, str) and 0 < hub_id.count("/") + 1 <= 2 and all(hub_id.split("/"))),
           f"hub_model_id must be 'owner/name' or 'name', got {hub_id!r}")
    _check(config["budget_clock"] in BUDGET_CLOCKS,
           f"budget_clock must be one of {list(BUDGET_CLOCKS)}, got {config['budget_clock']!r}")
    _check(_is_int(config["seed"]), f"seed must be an integer >= 0, got {config['seed']!r}")
    _check(_is_int(config["save_every"]), f"save_every must be an integer >= 0, got {config['save_every']!r}")
    _check(_is_int(config["keep_checkpoints"], 1), "keep_checkpoints must be an integer >= 1")
    stages = configured_stages(config)
    for name in stages:
        stage = config["stages"][name]
        _check(_is_int(stage["steps"]), f"stages.{name}.steps must be an integer >= 0, got {stage['steps']!r}")
        _check(_is_num(stage["lr"]) and stage["lr"] > 0, f"stages.{name}.lr must be a number > 0")
        mm = stage["max_minutes"]
        _check(mm is None or (_is_num(mm) and mm > 0), f"stages.{name}.max_minutes must be > 0 or null")
        _check(stage["schedule"] in SCHEDULES,
               f"stages.{name}.schedule must be one of {list(SCHEDULES)}, got {stage['schedule']!r}")
        _check(_is_int(stage["warmup_steps"]), f"stages.{name}.warmup_steps must be an integer >= 0")
    for name in stages:
        problem = STAGE_TYPES[name].check_config(config["stages"][name], config)
        _check(problem is None, problem or "")
    _check(any(config["stages"][s]["steps"] for s in stages),
           f"every stage has steps: 0; nothing to train (set stages.<{'|'.join(stages)}>.steps)")


def dump_config(config: dict[str, Any], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
