"""The names ``hf_kernel_attn.leaderboard.sweep`` held before the leaderboard was split by concern, re-exported
for the code that still imports them from here; new code imports from the modules that define them
(:mod:`.config`, :mod:`.runner`, :mod:`.render`, :mod:`.progress`, :mod:`.chance`, :mod:`.plots`)."""

from __future__ import annotations

from .chance import LOWER_IS_BETTER
from .config import load_leaderboard_config
from .plots import HEAT_RANGE, heat_values
from .progress import heartbeat
from .render import MAIN_METRIC, render
from .runner import leaderboard, run_leaderboard

__all__ = ["HEAT_RANGE", "LOWER_IS_BETTER", "MAIN_METRIC", "heat_values", "heartbeat", "leaderboard",
           "load_leaderboard_config", "render", "run_leaderboard"]
