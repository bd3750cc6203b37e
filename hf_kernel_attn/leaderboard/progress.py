"""Progress lines of a leaderboard sweep: durations as people read them, and a heartbeat that keeps a long step
from being silent (in worker processes too: they share the terminal, line-buffered)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["HEARTBEAT_SECONDS", "duration", "heartbeat"]

HEARTBEAT_SECONDS = 30.0  # every phase prints at least this often: a heartbeat while one step runs long


def duration(seconds: float) -> str:
    """``42 s`` or ``3 min 05 s``."""
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


@contextlib.contextmanager
def heartbeat(label: str, status: Callable[[], str] | None = None) -> Iterator[None]:
    """While the block runs, print ``LABEL: still running (TIME)[; STATUS]`` every :data:`HEARTBEAT_SECONDS`
    (a daemon thread; ``status()`` says how far it got), so that no phase is silent for long."""
    start, stop = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            extra = ""
            if status is not None:
                with contextlib.suppress(Exception):
                    extra = status()
            print(f"{label}: still running ({duration(time.perf_counter() - start)})"
                  + (f"; {extra}" if extra else ""), flush=True)

    thread = threading.Thread(target=beat, name=f"heartbeat {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
