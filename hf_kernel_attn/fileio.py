"""Writing files so that a reader never sees half of one, and reading append-only JSON-lines logs: the ground floor
every package may import (standard library and :mod:`.events` only).

``write_text_atomic`` writes a temporary file next to the target, flushes it to disk and renames it over the
target; the file gets the mode a plain ``open(path, "w")`` would give it (0666 less the umask, 0644 by default,
as transformers' own files have), not ``tempfile``'s 0600.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .events import reached


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask."""
    return 0o666 & ~umask()


def write_text_atomic(path: str | os.PathLike[str], text: str, event: str = "") -> None:
    """Replace ``path`` with ``text`` in one rename; on any failure the temporary file is removed and ``path``
    is unchanged. ``event``: a named point (:mod:`.events`) passed with the temporary file open and empty
    (info ``file`` and ``text``), where fault-injection tests kill the process."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if event:
                reached(event, file=f, text=text)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, plain_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """``data`` as indented, key-sorted JSON with a final newline (how transformers writes config.json)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_jsonl_lines(path: str | os.PathLike[str]) -> list[str]:
    """The complete JSON lines of an append-only log. Text after the last newline (a process killed, or a
    disk filled, in the middle of an append) is dropped unless it is a whole record; a line that ends in a
    newline but does not parse is corruption and raises, naming file:line."""
    *complete, tail = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
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


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none when it does not exist), through :func:`read_jsonl_lines`."""
    path = Path(path)
    return [json.loads(ln) for ln in read_jsonl_lines(path)] if path.exists() else []


def append_jsonl_atomic(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> None:
    """Add ``records`` to a JSON-lines file in one atomic replacement (a kill leaves the old file whole); the
    named point is ``append-K``, K the number of records the file held."""
    old = [json.dumps(r) for r in read_jsonl(path)]
    write_text_atomic(path, "".join(ln + "\n" for ln in old + [json.dumps(r) for r in records]), f"append-{len(old)}")
