"""The recall-versus-cache-bytes plot: its points (mean over tasks, then over rows' records) and Pareto front,
against brute force; the figures it writes."""

from __future__ import annotations

import itertools
import random

from hf_kernel_attn.leaderboard.bytes_plot import (
    Point,
    bytes_table,
    common_tasks,
    pareto_front,
    plot_recall_vs_bytes,
    recall_points,
)


def _brute_front(points):
    """Every point that no other point dominates (at most its bytes and more recall, or fewer bytes and as much)."""
    def beats(q, p):
        return (q.cache_bytes <= p.cache_bytes and q.recall > p.recall) or \
            (q.cache_bytes < p.cache_bytes and q.recall >= p.recall)
    return sorted((p for p in points if not any(beats(q, p) for q in points if q is not p)),
                  key=lambda p: p.cache_bytes)


def test_pareto_front_is_the_undominated_points():
    rng = random.Random(0)
    for _ in range(200):
        points = [Point(f"p{i}", rng.choice([1, 2, 4, 8, 16]) * 1e6, rng.choice([0, 25, 50, 75, 100]), 1)
                  for i in range(rng.randint(1, 9))]
        got = pareto_front(points)
        want = _brute_front(points)
        # ties in both bytes and recall: one of the equal points stands for them
        assert [(p.cache_bytes, p.recall) for p in got] == sorted({(p.cache_bytes, p.recall) for p in want})


def _rec(name, row, task, metric, value, length, cache, depth=None):
    return {"model_name": name, "kernel_row": row, "task": task, "metric": metric, "value": value,
            "length": length, "depth": depth, "cache_bytes": cache, "split": "validation"}


def test_points_average_tasks_then_rows(tmp_path):
    records = [_rec("m", "softmax", "niah_single_1", "score", 100, 1024, 40e6),
               _rec("m", "softmax", "ruler_vt", "score", 50, 1024, 42e6),
               _rec("m", "softmax", "ruler_vt", "score", 70, 2048, 80e6),
               _rec("m", "softmax+snapkv@10MiB", "niah_single_1", "score", 0, 1024, 10e6),
               *[_rec("m", "softmax", "niah", "exact_match", v, 1024, 41e6, d) for v, d in ((100, 10), (0, 90))],
               _rec("m", "softmax", "niah", "exact_match_multikey", 0, 1024, 41e6, 50)]
    (ruler_soft, ruler_snap) = sorted(recall_points(records, "RULER average", 1024), key=lambda p: -p.cache_bytes)
    assert (ruler_soft.label, ruler_soft.recall, ruler_soft.cache_bytes, ruler_soft.tasks) == ("m", 75, 41e6, 2)
    assert (ruler_snap.label, ruler_snap.recall, ruler_snap.tasks) == ("m / softmax+snapkv@10MiB", 0, 1)
    (niah,) = recall_points(records, "niah", 1024)
    assert (niah.recall, niah.cache_bytes) == (50, 41e6)
    written = plot_recall_vs_bytes(records, tmp_path)
    assert [p.name for p in written] == ["recall_vs_bytes_1024.png", "recall_vs_bytes_2048.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
    assert list(itertools.chain(recall_points(records, "niah", 2048))) == []


def test_the_table_shows_recall_bytes_and_decode_step_per_row_and_length():
    records = [_rec("m", "softmax", "niah_single_1", "score", 100, 1024, 40 * 2**20),
               _rec("m", "softmax", "ruler_vt", "score", 50, 1024, 42 * 2**20),
               {**_rec("m", "softmax", "niah", "exact_match", 100, 1024, 41 * 2**20, 50), "decode_ms_per_token": 30.0},
               {**_rec("m", "softmax", "passkey", "exact_match", 100, 1024, 41 * 2**20, 50),
                "decode_ms_per_token": 50.0},
               _rec("m", "softmax+tova@10MiB", "niah_single_1", "score", 0, 1024, 10 * 2**20)]
    lines = bytes_table(records)
    assert lines[2] == "| m | 1024 | 75 (2 tasks) | 100 | 41.0 | 40 |"
    assert lines[3] == "| m / softmax+tova@10MiB | 1024 | 0 (1 tasks) | – | 10.0 | – |"
    assert bytes_table([{**r, "cache_bytes": None} for r in records]) == []


def test_the_plotted_average_takes_the_tasks_every_row_has():
    records = [_rec("m", "softmax", "niah_single_1", "score", 100, 4096, 40e6),
               _rec("m", "softmax", "ruler_vt", "score", 0, 4096, 40e6),
               _rec("m", "softmax+tova@10MiB", "ruler_vt", "score", 50, 4096, 10e6)]
    assert common_tasks(records, "RULER average", 4096) == ("ruler_vt",)
    points = recall_points(records, "RULER average", 4096, common_tasks(records, "RULER average", 4096))
    assert sorted((p.label, p.recall) for p in points) == [("m", 0), ("m / softmax+tova@10MiB", 50)]
