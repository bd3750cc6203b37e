"""Kills and delays planted at the named points of a run (``hf_kernel_attn.events``), for the
kill/resume tests. In this process: ``events.listen(kill_at(name))``. In a subprocess, the CLI run with them:

    python tests/training/fault_injection.py [--kill-at NAME] [--sleep PREFIX=SECONDS ...] -- CLI ARGS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the checkout first

from hf_kernel_attn import events  # noqa: E402

SCRIPT = Path(__file__).resolve()


def kill_at(point: str):
    """SIGKILL this process at ``point``; a point that is about to write (a log line, a file's text) dies with
    half of it written."""

    def listener(name: str, **info) -> None:
        if name != point:
            return
        piece = info.get("line", info.get("text"))
        if "file" in info and piece is not None:
            info["file"].write(piece[: len(piece) // 2])
            info["file"].flush()
        os.kill(os.getpid(), signal.SIGKILL)

    return listener


def sleep_at(prefix: str, seconds: float):
    """Sleep ``seconds`` at every point whose name starts with ``prefix`` (a window to kill a run in)."""

    def listener(name: str, **info) -> None:
        if name.startswith(prefix):
            time.sleep(seconds)

    return listener


def command(*cli_args: str, kill: str | None = None, sleep: dict[str, float] | None = None) -> list[str]:
    """The argv of a CLI run with these faults."""
    argv = [sys.executable, str(SCRIPT)]
    if kill:
        argv += ["--kill-at", kill]
    for prefix, seconds in (sleep or {}).items():
        argv += ["--sleep", f"{prefix}={seconds}"]
    return [*argv, "--", *cli_args]


def main(argv: list[str]) -> int:
    while argv and argv[0] in ("--kill-at", "--sleep"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--kill-at":
            events.listen(kill_at(value))
        else:
            prefix, seconds = value.rsplit("=", 1)
            events.listen(sleep_at(prefix, float(seconds)))
    cli_args = argv[1:] if argv[:1] == ["--"] else argv  # a launcher may have dropped the "--"
    from hf_kernel_attn.cli import main as cli_main

    return cli_main(cli_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
