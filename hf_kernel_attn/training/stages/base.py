"""Training stages behind one registry: a stage is a :class:`TrainingStage` subclass decorated with
:func:`register_stage` -- its config keys and defaults, what it trains, its loss -- in one file."""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import torch

from ...registry import Registry
from ..context import RunContext
from ..tasks import TrainingTask


class Trains(str, enum.Enum):
    """What a stage trains: the kernels' own parameters, LoRA adapters, the model's weights, or the retention gates."""

    KERNEL = "kernel"
    LORA = "lora"
    FULL = "full"
    RETENTION = "retention"  # the retention gates of softmax layers with slots only


TRAINS = tuple(t.value for t in Trains)  # what a stage can train, as config values
# every stage's keys (a stage adds its own in `defaults`)
COMMON_DEFAULTS: dict[str, Any] = {"steps": 0, "lr": 1e-3, "max_minutes": None, "warmup_steps": 0,
                                   "schedule": "constant", "weight_decay": 0.0, "max_grad_norm": None}
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None, "train_kernel": False}


def register_stage(cls: type[TrainingStage]) -> type[TrainingStage]:
    """Class decorator: make ``cls`` the stage ``stages.<cls.name>`` of a finetune config, run in ``order``. The
    same class again is fine; another class under a taken name is a ValueError
    (:class:`hf_kernel_attn.registry.Registry`). A stage of one's own: register it in a module that the config's
    ``imports:`` names; its keys join the config when the config is read."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{getattr(cls, '__name__', repr(cls))} needs a class attribute `name`")
    STAGE_TYPES.register(cls.name, cls)
    return cls


def stage_names() -> tuple[str, ...]:
    """The registered stages in run order."""
    return tuple(sorted(STAGE_TYPES, key=lambda n: STAGE_TYPES[n].order))


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def check_lora_keys(name: str, stage: dict[str, Any]) -> str | None:
    if not _is_int(stage["r"], 1):
        return f"stages.{name}.r must be an integer >= 1, got {stage['r']!r}"
    if not (isinstance(stage["alpha"], (int, float)) and not isinstance(stage["alpha"], bool) and stage["alpha"] > 0):
        return f"stages.{name}.alpha must be > 0"
    targets = stage["target_modules"]
    if not (targets is None or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        return f"stages.{name}.target_modules must be null or a list of module names, got {targets!r}"
    return None


class TrainingStage:
    """One stage of a conversion run. The trainer runs it; the stage sees the run through ``self.context``
    (:class:`~hf_kernel_attn.training.RunContext`: config, device, model, ``student()`` -- the prepared model a
    step runs) and its task through ``self.task`` (:class:`~hf_kernel_attn.training.TrainingTask`: inputs, loss)."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 0  # stages run in increasing order
    defaults: ClassVar[dict[str, Any]] = {}  # this stage's keys beyond COMMON_DEFAULTS (and their overrides)
    train_mode: ClassVar[bool] = True  # the model's mode while it trains (dropout on)
    # the automatic layer and head choices (layers: auto:K, heads: ...:K), measured once attention transfer is
    # over, are applied before this stage runs
    applies_auto_choice: ClassVar[bool] = True
    fsdp: ClassVar[bool] = False  # the config's ``sharding: fsdp`` shards the model while this stage runs

    def __init__(self, context: RunContext, task: TrainingTask) -> None:
        self.context = context
        self.task = task
        self.cfg = context.config["stages"][self.name]

    @property
    def trainer(self) -> RunContext:
        raise AttributeError(f"{type(self).__name__}.trainer: a stage sees the run as `self.context` "
                             "(hf_kernel_attn.training.RunContext: config, device, model, student()) and its task "
                             "as `self.task` (inputs, loss), not the trainer")

    @classmethod
    def check_config(cls, stage: dict[str, Any], config: dict[str, Any]) -> str | None:
        """A problem with this stage's keys (an error message), or None."""
        return None

    def trains(self) -> Trains:
        """What the stage trains: :class:`Trains` (``kernel``, ``lora`` or ``full``)."""
        raise NotImplementedError

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError


STAGE_TYPES: Registry[type[TrainingStage]] = Registry("training stage", TrainingStage)
