"""Atomic checkpoints: written into a temporary folder, completed by ``manifest.json`` (every file's size,
written last), then renamed to ``checkpoint-<step>``; a folder is only ever listed once the rename has happened
and its files match its manifest.

A write that fails for any reason (disk full — which torch reports as a ``RuntimeError`` and the tokenizers
library as a plain ``Exception`` —, an I/O error, a bug) removes its temporary folder and raises
:class:`CheckpointWriteError` naming the folder, the cause and the free space; the checkpoints written before
stay as they were, so ``--resume`` continues from the newest of them. A folder that is replaced (``final/``, a
re-saved step) or pruned is first renamed aside (``.old-*``, ``.pruned-*``) and only then deleted, so a kill at
any point leaves every visible checkpoint complete; :func:`remove_partial` tidies what a kill left.
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

from ..events import reached
from ..fileio import plain_file_mode, read_jsonl_lines  # noqa: F401  (read_jsonl_lines: used through this module too)

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
MIB = 2**20


class CheckpointWriteError(OSError):
    """Writing a checkpoint (or the final model) failed; the earlier checkpoints are intact."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _disk_full(exc: BaseException, free: int | None) -> bool:
    """ENOSPC by errno, or by the text other libraries put in their own exception types (torch's
    ``RuntimeError: ... file write failed`` carries no errno; then a disk left with under 1 MiB counts)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    return "no space left" in text or "os error 28" in text or (free is not None and free < MIB)


def write_failed(what: str, output_dir: Path, exc: BaseException, free: int | None = None) -> CheckpointWriteError:
    """The error for a failed write of ``what`` in ``output_dir``: the cause, the free space on that disk when it
    failed, and the checkpoint a resume would use. ``free``: bytes free measured before the partial write was
    removed (measured now when None)."""
    free = free_bytes(output_dir) if free is None else free
    latest = latest_checkpoint(output_dir)
    full = _disk_full(exc, free)
    code = errno.ENOSPC if full else (exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO)
    if isinstance(exc, OSError) and exc.strerror:
        reason = f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, 'OSError')})"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    if full and "ENOSPC" not in reason:
        reason += " (No space left on device, ENOSPC)"
    space = f"{free / MIB:.1f} MiB free on that disk when it failed" if free is not None else "free space unknown"
    keep = (f"the newest complete checkpoint, {latest.name}, is intact" if latest is not None
            else "no complete checkpoint exists yet")
    hint = "free disk space and rerun with --resume" if full else "rerun with --resume"
    return CheckpointWriteError(code, f"could not write {what} in {str(output_dir)!r}: {reason}; {space}; the "
                                      f"partial write was removed and {keep}; {hint}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path, point: str | None = None) -> None:
    """Delete ``path`` file by file (deepest first), passing the named point ``point`` after each file (a kill
    there leaves the folder half deleted, as a real kill during ``rmtree`` does)."""
    if not path.exists():
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.remove(os.path.join(root, name))
            if point:
                reached(point)
        for name in dirs:
            os.rmdir(os.path.join(root, name))
    os.rmdir(path)


def write_manifest(folder: Path) -> None:
    """``manifest.json``: the size of every other file in ``folder`` (recursively), written last and flushed."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(folder).as_posix()] = p.stat().st_size
    with open(folder / MANIFEST, "w") as f:
        json.dump({"files": files}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def is_complete(folder: Path) -> bool:
    """``folder`` holds its manifest and every file the manifest lists, at the listed size."""
    try:
        with open(folder / MANIFEST) as f:
            files = json.load(f)["files"]
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


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
    """Write ``checkpoint-<step>`` atomically: every file of ``tensors`` (name -> object for torch.save),
    ``trainer_state.json`` and last ``manifest.json`` go to a temporary folder that is renamed when complete."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write_files(tmp, step, tensors, state)
    except BaseException as exc:
        free = free_bytes(output_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: cleaned up, then on their way
            raise
        raise write_failed(f"checkpoint-{step}", output_dir, exc, free) from exc
    reached(f"rename-{step}")
    replace_folder(tmp, final, f"checkpoint-{step}")
    return final


def replace_folder(tmp: Path, final: Path, point: str) -> None:
    """Give the complete folder ``tmp`` the name ``final``. An existing ``final`` is renamed aside first
    (``.old-<name>-<pid>``) and deleted only after the new one has its name; named points: ``swap-…`` between
    the two renames (``point`` with its ``checkpoint-`` stripped), ``delete-old-<name>`` after each deleted file."""
    parent = final.parent
    if final.exists():
        old = parent / f".old-{final.name}-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        reached(f"swap-{point.removeprefix('checkpoint-')}")
        os.replace(tmp, final)
        _fsync_dir(parent)
        remove_tree(old, f"delete-old-{final.name}")
    else:
        os.replace(tmp, final)
    _fsync_dir(parent)


def _write_files(tmp: Path, step: int, tensors: dict[str, Any], state: dict[str, Any]) -> None:
    mode = plain_file_mode()
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
    reached(f"save-{step}-{MANIFEST}")
    write_manifest(tmp)
    for p in tmp.iterdir():
        os.chmod(p, mode)


def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first: named ``checkpoint-<step>`` and matching their manifest (temporary,
    half-written and half-deleted folders are never listed)."""
    found = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and is_complete(p):
                found.append((int(m.group(1)), p))
    return sorted(found)


def incomplete_checkpoints(output_dir: Path) -> list[Path]:
    """Folders named ``checkpoint-<step>`` that do not match their manifest (or have none: written by a version
    before manifests, or damaged since); never resumed from."""
    if not output_dir.is_dir():
        return []
    return sorted(p for p in output_dir.iterdir() if _NAME.match(p.name) and p.is_dir() and not is_complete(p))


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1][1] if found else None


def remove_partial(output_dir: Path) -> None:
    """Delete what a killed process left: temporary folders, folders renamed aside for deletion. A complete
    ``.old-<name>`` whose replacement never got its name (killed between the two renames) becomes ``<name>``
    again instead."""
    if not output_dir.is_dir():
        return
    for p in sorted(output_dir.iterdir()):
        if not p.is_dir():
            continue
        m = re.match(r"^\.old-(checkpoint-\d+|final)-\d+$", p.name)
        if m and not (output_dir / m.group(1)).exists() and (m.group(1) == "final" or is_complete(p)):
            os.replace(p, output_dir / m.group(1))  # final/ is only moved aside whole, never half deleted
        elif p.name.startswith((".tmp-checkpoint-", ".old-", ".pruned-", ".tmp-final")):
            shutil.rmtree(p, ignore_errors=True)


def prune(output_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints: each is renamed aside (``.pruned-…``) before it is
    deleted, so a kill never leaves a half-deleted folder under a checkpoint's name."""
    for step, path in checkpoints(output_dir)[:-keep]:
        aside = output_dir / f".pruned-{path.name}-{os.getpid()}"
        os.replace(path, aside)
        reached(f"pruned-{step}")
        remove_tree(aside, f"delete-pruned-{step}")
    _fsync_dir(output_dir)


def read_state(path: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of checkpoint ``path``; a ValueError naming the file and the fix when it cannot
    be read."""
    file = path / STATE_FILE
    try:
        with open(file, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint state {str(file)!r} cannot be read ({type(exc).__name__}: {exc}); delete "
                         f"{path.name} to resume from the checkpoint before it") from None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise ValueError(f"checkpoint state {str(file)!r} is not a training state (no integer global_step); delete "
                         f"{path.name} to resume from the checkpoint before it")
    return state


def load_file(path: Path, name: str) -> Any:
    """One file of a checkpoint, unpickled with ``weights_only=True`` (tensors and plain Python values only: a
    file that holds any other object is refused, never run); a missing or unreadable one raises a ValueError
    naming it."""
    try:
        return torch.load(path / name, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise ValueError(f"checkpoint file {str(path / name)!r} cannot be read ({type(exc).__name__}: {exc}); "
                         f"delete {path.name} to resume from the checkpoint before it") from exc
