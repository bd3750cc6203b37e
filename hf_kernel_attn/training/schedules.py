"""Learning-rate schedules, built by ``transformers.get_scheduler``.

``constant``, ``cosine`` and ``linear`` warm up linearly over ``warmup_steps``; ``cosine`` and ``linear`` then
decay to ``FLOOR`` × the peak rate at ``steps`` (LoLCATs' recipe keeps a floor). Any other name is one of
transformers' ``SchedulerType`` names that needs no extra arguments (``lr_scheduler_type`` in
``TrainingArguments``), used as it is.
"""

from __future__ import annotations

from typing import Any

import torch

FLOOR = 0.1
OWN = ("constant", "cosine", "linear")
FROM_TRANSFORMERS = ("constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt")
SCHEDULES = OWN + FROM_TRANSFORMERS


def make_scheduler(optimizer: torch.optim.Optimizer, stage: dict[str, Any]) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of one stage (``schedule``, ``warmup_steps``, ``steps``) over ``optimizer``."""
    from transformers import get_scheduler

    kind, steps, warmup = stage["schedule"], stage["steps"], stage["warmup_steps"]
    if kind == "constant":
        return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)
    if kind == "cosine":
        return get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                             scheduler_specific_kwargs={"min_lr_rate": FLOOR})
    if kind == "linear":
        return get_scheduler("warmup_stable_decay", optimizer, num_warmup_steps=warmup,
                             scheduler_specific_kwargs={"num_decay_steps": max(1, steps - warmup),
                                                        "num_stable_steps": 0, "decay_type": "linear",
                                                        "min_lr_ratio": FLOOR})
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
