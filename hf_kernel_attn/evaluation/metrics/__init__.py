"""Offline `evaluate` metric modules shipped with hf_kernel_attn.

The hub versions (``evaluate.load("accuracy")``) need the network; these are plain metric scripts, one folder per
metric (``<name>/<name>.py``), loaded by absolute file path so that ``evaluate.load`` never tries the hub::

    from hf_kernel_attn.evaluation.metrics import load_metric
    load_metric("f1").compute(predictions=[0, 1, 1], references=[0, 1, 0], average="macro")

``evaluate.load`` copies the script into its dynamic-modules cache (``HF_MODULES_CACHE``, keyed by a hash of the
file), so that cache directory must be writable. This module imports nothing else from hf_kernel_attn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

METRICS_DIR: Path = Path(__file__).resolve().parent

METRIC_NAMES: tuple[str, ...] = (
    "accuracy",
    "f1",
    "matthews_correlation",
    "pearsonr",
    "spearmanr",
    "perplexity",
)

__all__ = ["METRICS_DIR", "METRIC_NAMES", "load_metric", "metric_path"]


def metric_path(name: str) -> str:
    """Absolute path of the metric script ``METRICS_DIR/<name>/<name>.py`` (a local path, so no hub lookup)."""
    if name not in METRIC_NAMES:
        raise ValueError(f"unknown metric {name!r}; valid names: {', '.join(METRIC_NAMES)}")
    return str(METRICS_DIR / name / f"{name}.py")


def load_metric(name: str, **kwargs: Any) -> Any:
    """``evaluate.load(metric_path(name), **kwargs)``: an ``evaluate.EvaluationModule``, loaded without network."""
    import evaluate  # deferred: importing evaluate pulls in transformers and torch

    return evaluate.load(metric_path(name), **kwargs)
