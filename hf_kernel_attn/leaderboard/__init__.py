"""The leaderboard: models × kernels × tasks, converted where asked (training) and scored (evaluation).

Modules: :mod:`.config` (the YAML, its overrides and checks), :mod:`.runner` (the resumable sweep),
:mod:`.workers` (a row's conversion and evaluation, worker processes), :mod:`.speed` (the speed benchmark),
:mod:`.render` (leaderboard.md / .csv), :mod:`.plots`, :mod:`.chance`, :mod:`.progress` (heartbeats)."""

from .config import load_leaderboard_config
from .render import render
from .runner import leaderboard, run_leaderboard

__all__ = ["leaderboard", "load_leaderboard_config", "render", "run_leaderboard"]
