"""The conversion-training config as typed dataclasses: every key's type, default and help (``metadata["help"]``),
checked on construction.

The YAML file is flat at the top (``model``, ``kernel``, ``seed``, ...) with two sections, ``data`` and ``stages``.
The top-level keys are grouped into :class:`ModelConfig`, :class:`KernelConfig`, :class:`BudgetConfig` and
:class:`OutputConfig`, which :class:`TrainingConfig` joins (their fields are its own); ``data`` is a
:class:`DataConfig` and ``stages.<name>`` a :class:`StageConfig` subclass built for each registered stage
(:func:`stage_config_class`: the common keys with that stage's defaults, and its own keys). The checks that need
the model (layer indices against its layer count) run when it loads (:func:`.model_setup.check_against_model`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..configfile import ConfigError
from .schedules import SCHEDULES
from .stages import COMMON_DEFAULTS, STAGE_TYPES

MIXED_PRECISION = ("no", "bf16", "fp16")
BUDGET_CLOCKS = ("wall", "cpu")
REQUIRED = ("model", "kernel", "output_dir")
# keys whose value is free-form (a mapping of the user's own keys)
OPEN_KEYS = {"kernel_params", "inference_params", "inference_layers", "layers", "config_overrides"}


def _help(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose ``metadata["help"]`` is ``text``."""
    return field(metadata={"help": text}, **kwargs)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_num(x: Any, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= low


@dataclass
class ModelConfig:
    """Top-level keys: the model converted, its task, the modules imported first."""

    model: str | None = _help("folder or hub id; `pkg:NAME/sub` = a folder inside an installed Python package "
                              "(required)", default=None)
    gguf_file: str | None = _help("convert this GGUF file inside `model` on the fly (written once to "
                                  "`output_dir/base-model`)", default=None)
    base_model_id: str | None = _help("the Hub id the model card names as `base_model` (default: `model`, if a Hub "
                                      "id)", default=None)
    model_class: str | None = _help("the transformers Auto class that loads the model, e.g. "
                                    "`AutoModelForSequenceClassification`; null: the task's", default=None)
    config_overrides: dict[str, Any] = _help("model config attributes set on load, e.g. `{hidden_dropout_prob: "
                                             "0.0}`", default_factory=dict)
    task: str = _help("`causal_lm` | `sequence_classification` | `sentence_embedding`, or a task registered by an "
                      "`imports` module", default="causal_lm")
    imports: list[str] = _help("modules imported before the config is checked: they register kernels, tasks or "
                               "stages of your own (docs/custom_kernels.md)", default_factory=list)


@dataclass
class KernelConfig:
    """Top-level keys: the kernel, the layers and heads it replaces, what the saved model adds."""

    kernel: str | None = _help("the kernel the layers are converted to, as in `hf_kernel_attn.patch` (required)",
                               default=None)
    kernel_params: dict[str, Any] = _help("the kernel's options (`hf-kernel-attn list KERNEL`)",
                                          default_factory=dict)
    layers: list[int] | dict[int, str] | str | None = _help(
        "null (every layer), a list of layer indices, `{index: kernel}`, or `auto:K`: every layer is converted, and "
        "once the transfer stage is over the K layers with the largest transfer error on the held-out text stay "
        "softmax (`auto_layers.json` in `output_dir`, `config.kernel_attention[\"auto\"]`; reused on `--resume`)",
        default=None)
    heads: str | None = _help(
        "null, `auto:K` (the K query heads with the largest transfer error) or `retrieval:K` (the K heads where the "
        "softmax teacher attends most to a stated fact while answering for it, on recall blocks of the held-out "
        "text; causal LMs): kept as exact softmax, chosen after transfer (`auto_heads.json`)", default=None)
    heads_share_kv: bool = _help("true: K counts KV heads, each kept with every query head that reads it (they "
                                 "share one K/V cache, so they cost nothing more)", default=False)
    inference_params: dict[str, Any] = _help(
        "kernel options added to the saved model's kernel (every layer that runs it) after training, for options "
        "that need no training: `{sparse_cache: 64}` saves a window hybrid with a bounded sparse cache "
        "(docs/long_context.md); checked with `kernel_params` when the config is read", default_factory=dict)
    inference_layers: dict[int, dict[str, Any]] = _help(
        "`{layer index: kernel options}` added to those layers of the saved model only, on top of "
        "`inference_params`, after training: `{7: {sinks: 40, softmax_heads: [0, 1, 2]}}` makes layer 7 a "
        "retrieval layer on a budget (with a `sparse_cache`; docs/long_context.md). A layer running another kernel "
        "(softmax) takes no options here", default_factory=dict)


@dataclass
class BudgetConfig:
    """Top-level keys: seed, threads, the clock of the minute budgets, precision, memory, sharding."""

    seed: int = _help("data order, new heads, LoRA init", default=0)
    threads: int | None = _help("torch threads (null: torch's default)", default=None)
    budget_clock: str = _help("what a minute of `stages.<name>.max_minutes` is: `wall` (wall-clock) or `cpu` "
                              "(this process's CPU time divided by its torch thread count)", default="wall")
    mixed_precision: str | None = _help(
        "`no` | `bf16` | `fp16`: accelerate's autocast around each training forward (weights and optimizer stay "
        "fp32); null: the launcher's accelerate config, else `no`. The resolved config saves what ran",
        default=None)
    gradient_checkpointing: bool = _help("true: each layer is recomputed in backward (distill, lora, full; transfer "
                                         "runs in eval mode)", default=False)
    sharding: str = _help("`none` | `fsdp`: the `full` stage sharded with FSDP2 over the processes",
                          default="none")


@dataclass
class OutputConfig:
    """Top-level keys: where the run writes checkpoints, logs and the final model, and its upload."""

    output_dir: str | None = _help("the run's folder: checkpoints, logs, `final/` (required)", default=None)
    save_every: int = _help("steps between checkpoints (0: none but each stage's end)", default=100)
    keep_checkpoints: int = _help("checkpoints kept (the oldest are deleted)", default=2)
    merge_lora: bool = _help("merge the LoRA adapters into the saved model's weights", default=True)
    validate: bool = _help("score the held-out slice before training and after each stage (`validation.jsonl`)",
                           default=True)
    log_with: str = _help("`auto` (tensorboard when installed) | `none` | `tensorboard` | `wandb` ...: accelerate's "
                          "trackers", default="auto")
    push_to_hub: bool = _help("upload `final/` (weights, tokenizer, model card) to `hub_model_id` when the run "
                              "ends; a failed upload is an error naming the repo (exit 1), `final/` is kept",
                              default=False)
    hub_model_id: str | None = _help("`owner/name` (or `name`, under your account); null: `output_dir`'s name",
                                     default=None)
    hub_private_repo: bool = _help("create the Hub repo private", default=False)


@dataclass
class DataConfig:
    """The data section: the training text or examples and how they are batched."""

    train: list[str] | str = _help("list of local files, or a hub dataset id (required)", default_factory=list)
    glue_task: str | None = _help("column layout of GLUE files (`sst2`, `mrpc`, `rte`, `cola`, `stsb`, `qnli`)",
                                  default=None)
    text_column: str = _help("the text column of a hub text dataset", default="text")
    seq_len: int = _help("tokens per block", default=512)
    batch_size: int = _help("micro-batch per process", default=4)
    grad_accum: int = _help("micro-batches accumulated per optimizer step", default=1)
    validation_fraction: float = _help("the end of each text file held out; GLUE files hold out every 10th row",
                                       default=0.05)
    validation_batches: int = _help("held-out batches scored per validation", default=8)
    max_train_chars: int | None = _help("characters read per text file (null: all)", default=None)
    recall_fraction: float = _help("causal_lm: share of training blocks carrying synthetic key-value facts",
                                   default=0.0)
    recall_max_facts: int = _help("facts per such block (1 ... this), each stated once and asked at the end",
                                  default=3)
    recall_style: str = _help("wording of those facts: plain (one sentence form, 5-digit numbers) or varied "
                              "(several forms, keys and value formats)", default="plain")

    def __post_init__(self) -> None:
        _check(isinstance(self.train, (str, list)) and bool(self.train),
               "data.train must be a list of local files or a hub dataset id")
        for key in ("seq_len", "batch_size", "grad_accum", "validation_batches"):
            value = getattr(self, key)
            _check(_is_int(value, 1), f"data.{key} must be an integer >= 1, got {value!r}")
        _check(_is_num(self.validation_fraction) and self.validation_fraction < 1,
               f"data.validation_fraction must be in [0, 1), got {self.validation_fraction!r}")
        _check(_is_num(self.recall_fraction) and self.recall_fraction <= 1,
               f"data.recall_fraction must be in [0, 1], got {self.recall_fraction!r}")
        _check(_is_int(self.recall_max_facts, 1),
               f"data.recall_max_facts must be an integer >= 1, got {self.recall_max_facts!r}")
        _check(self.recall_style in ("plain", "varied"),
               f"data.recall_style must be one of ['plain', 'varied'], got {self.recall_style!r}")


@dataclass
class StageConfig:
    """The stages section, one mapping per stage: the keys every stage has, then each stage's own.

    Each registered stage gets a subclass (:func:`stage_config_class`) with its defaults and own keys."""

    stage_name: ClassVar[str] = "<name>"  # the stage's name, in the error messages
    steps: int = _help("optimizer steps (0: the stage is skipped)", default=COMMON_DEFAULTS["steps"])
    lr: float = _help("peak learning rate", default=COMMON_DEFAULTS["lr"])
    max_minutes: float | None = _help("ends the stage cleanly (checkpoint, then the next stage) after this many "
                                      "`budget_clock` minutes; null: no limit", default=COMMON_DEFAULTS["max_minutes"])
    warmup_steps: int = _help("steps of linear warm-up", default=COMMON_DEFAULTS["warmup_steps"])
    schedule: str = _help(f"learning-rate schedule: {' | '.join(SCHEDULES)}", default=COMMON_DEFAULTS["schedule"])
    weight_decay: float = _help("AdamW weight decay", default=COMMON_DEFAULTS["weight_decay"])
    max_grad_norm: float | None = _help("gradient clipping norm (null: none)", default=COMMON_DEFAULTS["max_grad_norm"])

    def __post_init__(self) -> None:
        name = self.stage_name
        _check(_is_int(self.steps), f"stages.{name}.steps must be an integer >= 0, got {self.steps!r}")
        _check(_is_num(self.lr) and self.lr > 0, f"stages.{name}.lr must be a number > 0")
        mm = self.max_minutes
        _check(mm is None or (_is_num(mm) and mm > 0), f"stages.{name}.max_minutes must be > 0 or null")
        _check(self.schedule in SCHEDULES,
               f"stages.{name}.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        _check(_is_int(self.warmup_steps), f"stages.{name}.warmup_steps must be an integer >= 0")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# the built-in stages' own keys: type and help (a stage of one's own shows its keys' types from their defaults)
STAGE_KEYS: dict[str, tuple[str, str]] = {
    "loss": ("str", "transfer: the layer-local loss, `mse` (output MSE)"),
    "r": ("int", "LoRA rank"),
    "alpha": ("float", "LoRA alpha (the adapters' scale is alpha / r)"),
    "dropout": ("float", "LoRA dropout"),
    "target_modules": ("list[str] | None", "LoRA: the modules adapted (null: the model family's attention "
                                           "projections); distill with `train: full`: only these train"),
    "train_kernel": ("bool", "the kernel's own parameters train too"),
    "temperature": ("float", "distill, retention (kl): τ of the teacher's and student's next-token distributions"),
    "objective": ("str", "retention: `kl` (soft retention, KL to the full softmax + capacity term) | `attention` "
                         "(BCE on the keys the full softmax reads most after the window)"),
    "read_distance": ("int", "retention (attention): a key's label counts only the reads of queries at least "
                             "this many positions later (0: the window W)"),
    "fact_labels": ("bool", "retention (attention): state recall facts in every block (data.recall_max_facts, "
                            "data.recall_style) and label their tokens as keys to keep"),
    "capacity_weight": ("float", "retention (kl): the weight of the capacity term mean_t |E_t - min(C, n_t)| / C"),
    "ce_weight": ("float", "distill: the weight of the cross-entropy added to τ² · KL"),
    "train": ("str", "distill: `lora` (adapters) | `full` (the weights)"),
}
_COMMON = {f.name: f for f in dataclasses.fields(StageConfig)}


def _default(value: Any, text: str) -> Any:
    """A field defaulting to ``value`` (a fresh copy each time where it is a list or a mapping)."""
    if isinstance(value, (dict, list)):
        return _help(text, default_factory=lambda: copy.deepcopy(value))
    return _help(text, default=value)


_STAGE_CLASSES: dict[tuple[str, type, str], type[StageConfig]] = {}


def stage_config_class(name: str) -> type[StageConfig]:
    """The dataclass of ``stages.<name>`` for the stage registered as ``name``: the common keys with the stage's
    defaults, then its own keys (type and help from :data:`STAGE_KEYS`, else the default's type). One class per
    registered stage class and defaults (equal configs compare equal)."""
    stage = STAGE_TYPES[name]
    key = (name, stage, repr(stage.defaults))
    if key not in _STAGE_CLASSES:
        _STAGE_CLASSES[key] = _build_stage_class(name, stage.defaults)
    return _STAGE_CLASSES[key]


def _build_stage_class(name: str, own: dict[str, Any]) -> type[StageConfig]:
    specs: list[tuple[str, Any, Any]] = []
    for key, value in {**COMMON_DEFAULTS, **own}.items():
        if key in _COMMON:
            base = _COMMON[key]
            specs.append((key, base.type, _default(value, base.metadata["help"])))
            continue
        kind, text = STAGE_KEYS.get(key, (type(value).__name__ if value is not None else "Any", f"stage {name}'s key"))
        specs.append((key, kind, _default(value, text)))
    title = "".join(part.title() for part in name.split("_"))
    return dataclasses.make_dataclass(f"{title}StageConfig", specs, bases=(StageConfig,),
                                      namespace={"stage_name": name})


def field_defaults(cls: type) -> dict[str, Any]:
    """Each field of the dataclass ``cls`` and its default (a fresh copy)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = copy.deepcopy(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out
