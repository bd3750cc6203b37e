"""Evaluation: offline ``evaluate`` metric modules (``evaluation/metrics``)."""
