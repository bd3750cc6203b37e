"""Atomic checkpoints: written into a temporary folder, completed by ``trainer_state.json``, then
renamed to ``checkpoint-<step>``; a folder is only ever picked up once the rename has happened."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_checkpoint(output_dir: Path, step: int, tensors: dict[str, Any], state: dict[str, Any]) -> Path:
    """Write ``checkpoint-<step>`` atomically: every file of ``tensors`` (name -> object for torch.save)
    and then ``trainer_state.json`` go to a temporary folder that is renamed when complete."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    delay = float(os.environ.get("HF_KERNEL_ATTN_CHECKPOINT_DELAY", 0))  # tests: a window to kill a write in
    for i, (name, obj) in enumerate(tensors.items()):
        if i == 1 and delay:
            time.sleep(delay)
        with open(tmp / name, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (a resumed stage end): replace it whole
        old = output_dir / f".old-checkpoint-{step}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(output_dir)
    return final


def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    found = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1][1] if found else None


def remove_partial(output_dir: Path) -> None:
    """Delete temporary folders left by a process killed while writing."""
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            if p.name.startswith((".tmp-checkpoint-", ".old-checkpoint-", ".tmp-final")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def prune(output_dir: Path, keep: int) -> None:
    for _, path in checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_state(path: Path) -> dict[str, Any]:
    with open(path / STATE_FILE) as f:
        return json.load(f)


def load_file(path: Path, name: str) -> Any:
    return torch.load(path / name, map_location="cpu", weights_only=False)
