"""Atomic checkpoints: written into a temporary folder, completed by ``trainer_state.json``, then
renamed to ``checkpoint-<step>``; a folder is only ever picked up once the rename has happened.

A write that fails (disk full, I/O error) removes its temporary folder and raises
:class:`CheckpointWriteError`; the checkpoints written before stay as they were, so ``--resume`` continues
from the newest of them.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .events import reached

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointWriteError(OSError):
    """Writing a checkpoint (or the final model) failed; the earlier checkpoints are intact."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def write_failed(what: str, output_dir: Path, exc: OSError) -> CheckpointWriteError:
    """The error for a failed write of ``what``, naming the cause and the checkpoint a resume would use."""
    latest = latest_checkpoint(output_dir)
    code = errno.errorcode.get(exc.errno or 0, "")
    reason = f"{exc.strerror or exc}" + (f" ({code})" if code else "")
    keep = (f"the newest complete checkpoint, {latest.name}, is intact" if latest is not None
            else "no complete checkpoint exists yet")
    hint = "free disk space and rerun with --resume" if exc.errno == errno.ENOSPC else "rerun with --resume"
    return CheckpointWriteError(exc.errno or errno.EIO,
                                f"could not write {what} in {str(output_dir)!r}: {reason}; the partial write was "
                                f"removed and {keep}; {hint}")


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
    """The RNG states as tensors and plain Python values only, so that ``rng.pt`` loads with
    ``torch.load(weights_only=True)`` (no pickled objects: a tampered checkpoint cannot run code)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))


def save_checkpoint(output_dir: Path, step: int, tensors: dict[str, Any], state: dict[str, Any]) -> Path:
    """Write ``checkpoint-<step>`` atomically: every file of ``tensors`` (name -> object for torch.save)
    and then ``trainer_state.json`` go to a temporary folder that is renamed when complete."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write_files(tmp, step, tensors, state)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(f"checkpoint-{step}", output_dir, exc) from exc
    reached(f"rename-{step}")
    if final.exists():  # re-saving the same step (a resumed stage end): replace it whole
        old = output_dir / f".old-checkpoint-{step}-{os.getpid()}"
        os.replace(final, old)
        reached(f"swap-{step}")
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(output_dir)
    return final


def _write_files(tmp: Path, step: int, tensors: dict[str, Any], state: dict[str, Any]) -> None:
    for name, obj in tensors.items():
        reached(f"save-{step}-{name}")
        with open(tmp / name, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    reached(f"save-{step}-{STATE_FILE}")
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


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
    """Delete temporary folders left by a process killed while writing. A complete ``.old-checkpoint-<step>``
    whose replacement never got its name back (killed between the two renames) becomes ``checkpoint-<step>``
    again instead."""
    if not output_dir.is_dir():
        return
    for p in sorted(output_dir.iterdir()):
        m = re.match(r"^\.old-(checkpoint-\d+)-\d+$", p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file() and not (output_dir / m.group(1)).exists():
            os.replace(p, output_dir / m.group(1))
        elif p.name.startswith((".tmp-checkpoint-", ".old-checkpoint-", ".tmp-final")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def prune(output_dir: Path, keep: int) -> None:
    for _, path in checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_state(path: Path) -> dict[str, Any]:
    with open(path / STATE_FILE) as f:
        return json.load(f)


def load_file(path: Path, name: str) -> Any:
    """One file of a checkpoint, unpickled with ``weights_only=True`` (tensors and plain Python values only: a
    file that holds any other object is refused, never run); a missing or unreadable one raises a ValueError
    naming it."""
    try:
        return torch.load(path / name, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise ValueError(f"checkpoint file {str(path / name)!r} cannot be read ({type(exc).__name__}: {exc}); "
                         f"delete {path.name} to resume from the checkpoint before it") from exc


def read_jsonl_lines(path: Path) -> list[str]:
    """The complete JSON lines of an append-only log. Text after the last newline (a process killed, or a
    disk filled, in the middle of an append) is dropped unless it is a whole record; a line that ends in a
    newline but does not parse is corruption and raises, naming file:line."""
    *complete, tail = path.read_text(encoding="utf-8", errors="replace").split("\n")
    out = []
    for i, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i}: corrupted record {line[:80]!r}; fix or delete that line") from None
        out.append(line)
    if tail.strip():
        try:
            json.loads(tail)
        except json.JSONDecodeError:
            return out
        out.append(tail)
    return out
