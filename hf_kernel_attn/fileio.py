"""Writing files so that a reader never sees half of one: the ground floor every package may import (standard
library only).

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


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask."""
    return 0o666 & ~umask()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` in one rename; on any failure the temporary file is removed and ``path``
    is unchanged."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
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
