"""Reading local text data files with errors that name the file: missing, binary, not UTF-8, empty."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

BINARY_PROBE = 8192  # bytes inspected for NUL bytes


def read_text_file(path: str | os.PathLike[str], what: str = "data file", *, encoding: str = "utf-8",
                   allow_empty: bool = True) -> str:
    """The text of ``path``. FileNotFoundError when it is not a file; ValueError (naming the file, the byte
    and its offset) when it holds NUL bytes (a binary file) or is not valid ``encoding``, and when it is empty
    (only whitespace) unless ``allow_empty``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    raw = path.read_bytes()
    nul = raw.find(b"\x00", 0, BINARY_PROBE)
    if nul >= 0:
        raise ValueError(f"{what} {str(path)!r} looks like a binary file (NUL byte at offset {nul}); "
                         f"expected {encoding.upper().replace('-SIG', '')} text")
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{what} {str(path)!r} is not {encoding.upper().replace('-SIG', '')} text: byte "
                         f"0x{raw[exc.start]:02x} at offset {exc.start} (line {line}) cannot be decoded; "
                         "convert the file to UTF-8") from None
    if not allow_empty and not text.strip():
        raise ValueError(f"{what} {str(path)!r} is empty ({len(raw)} bytes, no text)")
    return text


def json_objects(lines: Iterable[str], path: str | os.PathLike[str], *,
                 skip_blank: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """``("file:line", object)`` for each JSON line; ValueError naming file:line for invalid JSON or a value
    that is not an object. ``skip_blank`` passes over whitespace-only lines (their numbers still count)."""
    for lineno, line in enumerate(lines, start=1):
        if skip_blank and not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record
