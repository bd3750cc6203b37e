"""Sharded full fine-tuning with torch's FSDP2 (``fully_shard``), for ``sharding: fsdp``.

Under ``torchrun`` (or ``accelerate launch`` without accelerate's own FSDP, e.g. on CPU with gloo) every
block the model names in ``_no_split_modules`` (a decoder or encoder layer: its attention, kernel and MLP),
and then the model itself, becomes one FSDP2 unit: each process keeps 1/P of each unit's parameters, gradients
and optimizer state, all-gathers a unit's weights just for its forward and backward and reduce-scatters its
gradients (averaged over processes, as DDP averages them). Checkpoints hold the full (gathered) tensors, so a
sharded run resumes with any number of processes and saves an ordinary ``save_pretrained`` folder.
"""

from __future__ import annotations

from typing import Any

import torch

SHARDINGS = ("none", "fsdp")


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks ``model`` declares unsplittable (``_no_split_modules``), outermost first."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(f"sharding: fsdp shards each block the model lists in _no_split_modules; "
                         f"{type(model).__name__} lists none")
    return units


def shard(model: torch.nn.Module) -> None:
    """Make each unit of :func:`shard_units`, then ``model``, an FSDP2 module (in place)."""
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(model):
        fully_shard(unit)
    fully_shard(model)


def local_parameter_count(model: torch.nn.Module) -> tuple[int, int]:
    """(elements of the parameters this process holds, elements of the whole model)."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total


def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's tensors on the CPU of process 0 (empty elsewhere); every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state (keyed by parameter name) on process 0; every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Give each process its shard of a full optimizer state written by :func:`full_optimizer_state`."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # strict=False: a parameter that never had a gradient (an unused pooler) has no state, as unsharded
    set_optimizer_state_dict(model, optimizer, state, options=_options(strict=False))
