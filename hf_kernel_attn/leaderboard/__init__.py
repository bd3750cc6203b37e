"""The leaderboard: models × kernels × tasks, converted where asked (training) and scored (evaluation)."""

from .sweep import leaderboard, load_leaderboard_config, render, run_leaderboard

__all__ = ["leaderboard", "load_leaderboard_config", "render", "run_leaderboard"]
