"""Named points a training run (and a leaderboard sweep) passes, for observers: progress probes, timing,
fault-injection tests.

The run calls ``reached(name, **info)`` at each point; ``listen(fn)`` registers ``fn(name, **info)`` in this
process and returns a function that removes it. Points, for optimizer step N:

* ``begin-step-N`` before the step's first micro-batch; ``step-N`` once the step is done;
* ``log-N`` before its record is appended (info: ``file``, the open log, and ``line``, the record);
* at a checkpoint: ``save-N-FILE`` before each file (``manifest.json`` last), ``rename-N`` before the folder
  takes its name, ``swap-N`` between the two renames of a re-saved step (then ``delete-old-checkpoint-N`` after
  each file of the old folder is deleted), ``prune-N`` before older checkpoints are removed, ``pruned-K`` once
  checkpoint K is renamed aside and ``delete-pruned-K`` after each of its files is deleted;
* ``save-final`` before the final model is written, ``final`` before ``final/`` takes its name; when it
  replaces an existing one, ``swap-final`` between the two renames and ``delete-old-final`` after each file of
  the old one is deleted;
* the leaderboard: ``append-K`` before a cell's records join the K that results.jsonl holds (info: ``file``,
  the open temporary file that replaces it, and ``text``, what it is about to hold).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Listener = Callable[..., None]
_LISTENERS: list[Listener] = []


def listen(fn: Listener) -> Callable[[], None]:
    """Call ``fn(name, **info)`` at every point; returns the function that stops it."""
    _LISTENERS.append(fn)

    def stop() -> None:
        if fn in _LISTENERS:
            _LISTENERS.remove(fn)

    return stop


def reached(name: str, **info: Any) -> None:
    for fn in list(_LISTENERS):
        fn(name, **info)
