"""The leaderboard's plots: chance levels from the tasks themselves, heat-map cells at chance hatched and labelled
instead of a ratio to softmax, a speed plot with every timed model, titles / labels / legends; and the sweep's
heartbeat."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from tests.paths import DATA

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hf_kernel_attn.leaderboard.chance import Chance, at_chance, chance_level, multiple_choice_chance  # noqa: E402
from hf_kernel_attn.leaderboard.plots import heat_grid, heatmap_figure, speed_figure  # noqa: E402


def _rec(name, kernel, task, metric, value, n=40, stderr=None):
    return {"model_name": name, "kernel_row": kernel, "task": task, "split": "validation", "metric": metric,
            "value": value, "stderr": stderr, "n": n}


def test_multiple_choice_chance_is_the_mean_of_one_over_choices():
    c = multiple_choice_chance([4, 4, 3, 5])
    # by hand: (1/4 + 1/4 + 1/3 + 1/5) / 4 = 0.258333...; se = sqrt(2 * 3/16 + 2/9 + 4/25) / 4
    assert c.value == pytest.approx(0.2583333333)
    assert c.se == pytest.approx(0.2175461)
    assert c.threshold == pytest.approx(0.2583333333 + 0.2175461)


def test_chance_levels_by_kind_of_task():
    assert chance_level("wikitext2", "perplexity", 2044) is None  # no guessing level
    assert chance_level("position_loss", "loss", 10) is None
    spear = chance_level("stsb_embedding", "spearman", 574)  # uncorrelated: 0, se 100 / sqrt(573)
    assert spear.value == 0 and spear.se == pytest.approx(4.17756, rel=1e-5)
    passkey = chance_level("passkey", "exact_match", 20)  # a generated 5-digit answer: 0
    assert (passkey.value, passkey.se) == (0.0, 0.0)
    sst2 = chance_level("sst2", "accuracy", 100)  # 2 labels, ×100: 50 ± 100 * sqrt(0.25 / 100)
    assert (sst2.value, sst2.se) == pytest.approx((50.0, 5.0))
    own = chance_level("mqar-short", "accuracy", 500, record={"chance": 6.25, "stderr": 1.5})  # synthetic tasks
    assert (own.value, own.se) == (6.25, 1.5)
    assert chance_level("some_unknown_task", "accuracy", 10) is None


def test_f1_chance_is_near_its_closed_form():
    """MRPC's F1 under uniform guessing: precision = the positive rate p, recall 1/2, F1 ~ p / (p + 1/2)."""
    from hf_kernel_attn.leaderboard.chance import _simulated_f1

    gold = [1] * 68 + [0] * 32
    c = _simulated_f1(gold, 2)
    assert c.value == pytest.approx(100 * 0.68 / 1.18, abs=1.0)
    assert 2 < c.se < 10


@pytest.mark.skipif(not (DATA / "arc" / "ARC-Easy-Dev.jsonl").is_file(), reason="no local ARC-Easy data")
def test_arc_easy_chance_comes_from_lm_evals_choices_of_the_evaluated_questions():
    pytest.importorskip("lm_eval")
    rows = [json.loads(ln) for ln in (DATA / "arc" / "ARC-Easy-Dev.jsonl").read_text().splitlines() if ln.strip()]
    choices = [len(r["question"]["choices"]) for r in rows]
    assert set(choices) == {3, 4, 5}  # not every question has 4 choices
    c40 = chance_level("arc_easy", "acc_norm", 40, data_dir=DATA)
    assert c40.value == pytest.approx(sum(1 / k for k in choices[:40]) / 40)
    assert c40.value == pytest.approx((39 / 4 + 1 / 5) / 40)  # the 18th question has 5 choices
    assert c40.se == pytest.approx(math.sqrt(39 * 3 / 16 + 4 / 25) / 40)
    full = chance_level("arc_easy", "acc_norm", len(rows), data_dir=DATA)
    assert full.value == pytest.approx(sum(1 / k for k in choices) / len(choices))
    assert at_chance(0.25, c40) and at_chance(0.3, c40) and not at_chance(0.325, c40) and not at_chance(0.425, c40)
    lambada = chance_level("lambada_openai", "acc", 40, data_dir=DATA)  # no choice set: the whole vocabulary
    assert (lambada.value, lambada.se) == (0.0, 0.0) and at_chance(0.0, lambada) and not at_chance(0.025, lambada)


def _board():
    rows = [("m", "softmax"), ("m", "elu"), ("m", "relu")]
    columns = ["wikitext2", "arc_easy", "lambada_openai"]
    values = {"softmax": (20.0, 0.5, 0.3), "elu": (40.0, 0.32, 0.0), "relu": (10.0, 0.4, 0.15)}
    metrics = ("perplexity", "acc_norm", "acc")
    cell = {("m", k, t): _rec("m", k, t, metric, v) for k, vs in values.items()
            for t, metric, v in zip(columns, metrics, vs, strict=True)}
    arc, lambada = Chance(0.25, 0.07, "test"), Chance(0.0, 0.0, "test")
    chances = {key: {"wikitext2": None, "arc_easy": arc, "lambada_openai": lambada}[key[2]] for key in cell}
    return rows, columns, cell, chances


def test_heat_grid_marks_cells_at_chance_instead_of_a_ratio():
    rows, columns, cell, chances = _board()
    ratios, chance = heat_grid(rows, columns, cell, chances)
    # elu: arc 0.32 <= 0.25 + 0.07 (at the line), lambada 0.0 <= 0; the rest are ratios to softmax
    assert chance.tolist() == [[False, False, False], [False, True, True], [False, False, False]]
    want = np.array([[1.0, 1.0, 1.0], [0.5, np.nan, np.nan], [2.0, 0.8, 0.5]])  # perplexity inverted: 20/40, 20/10
    np.testing.assert_allclose(ratios, want, equal_nan=True)


def test_heat_map_hatches_and_labels_the_chance_cells():
    rows, columns, cell, chances = _board()
    fig = heatmap_figure(rows, columns, cell, chances)
    try:
        ax = fig.axes[0]
        labelled = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
        assert labelled[(1, 1)] == labelled[(2, 1)] == "chance"  # (column, row)
        assert [k for k, v in labelled.items() if v == "chance"] == [(1, 1), (2, 1)]
        assert labelled[(1, 2)] == "0.80" and labelled[(0, 1)] == "0.50"
        hatched = sorted((p.get_xy()[0] + 0.5, p.get_xy()[1] + 0.5) for p in ax.patches if p.get_hatch())
        assert hatched == [(1.0, 1.0), (2.0, 1.0)]
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
        assert "softmax" in fig.axes[1].get_ylabel()  # the colour bar says what the colour is
        legend = " ".join(t.get_text() for leg in fig.legends for t in leg.get_texts())
        assert "chance" in legend and "standard error" in legend
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert "chance 0.25" in ticks[1] and "chance 0" in ticks[2] and "chance" not in ticks[0]
    finally:
        plt.close(fig)


def _speed_rows(model, ratios):
    return [{"model": model, "kernel": k, "length": 64, "time_s": 0.01 * r, "ratio_vs_softmax": r, "status": "ok"}
            for k, r in ratios.items()]


def test_speed_plot_has_every_timed_model_a_title_and_a_legend():
    rows = [("llm", "softmax"), ("llm", "elu"), ("enc", "softmax"), ("enc", "elu"), ("enc", "cosine"),
            ("enc (converted)", "elu")]
    columns = ["wikitext2", "stsb_embedding"]
    cell = {("llm", "softmax", "wikitext2"): _rec("llm", "softmax", "wikitext2", "perplexity", 20.0),
            ("llm", "elu", "wikitext2"): _rec("llm", "elu", "wikitext2", "perplexity", 80.0)}
    for kernel, v in (("softmax", 80.0), ("elu", 60.0), ("cosine", 70.0)):  # the encoder has no perplexity
        cell[("enc", kernel, "stsb_embedding")] = _rec("enc", kernel, "stsb_embedding", "spearman", v)
    cell[("enc (converted)", "elu", "stsb_embedding")] = _rec("enc (converted)", "elu", "stsb_embedding",
                                                              "spearman", 79.0)
    speed = (_speed_rows("llm", {"softmax": 1.0, "elu": 0.9}) + _speed_rows("enc", {"softmax": 1.0, "elu": 1.2,
                                                                                     "cosine": 1.1})
             + _speed_rows("bare", {"softmax": 1.0, "elu": 1.5}))  # timed, never scored
    fig = speed_figure(rows, columns, cell, speed, {}, {("enc (converted)", "elu"): ("enc", "elu")})
    try:
        panels = [ax for ax in fig.axes if ax.get_title()]
        assert [ax.get_title() for ax in panels] == ["llm", "enc", "bare"]
        assert fig._suptitle is not None and "forward time" in fig._suptitle.get_text()
        assert all(ax.get_xlabel() and ax.get_ylabel() for ax in panels)
        assert "wikitext2" in panels[0].get_ylabel() and "stsb_embedding" in panels[1].get_ylabel()
        points = {ax.get_title(): sorted((float(x), float(y)) for c in ax.collections for x, y in c.get_offsets())
                  for ax in panels[:2]}
        assert points["llm"] == [(0.9, 80.0), (1.0, 20.0)]
        assert points["enc"] == [(1.0, 80.0), (1.1, 70.0), (1.2, 60.0), (1.2, 79.0)]  # the converted row: elu's time
        assert [p.get_height() for p in panels[2].patches] == [1.0, 1.5]  # bars of the time ratios
        legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
        assert {"softmax", "elu", "cosine"} <= set(legend)
    finally:
        plt.close(fig)
    assert speed_figure(rows, columns, cell, []) is None  # nothing timed: no plot


def test_render_writes_the_chance_notes_and_plots(tmp_path):
    from hf_kernel_attn.leaderboard.render import render

    cfg = {"output_dir": str(tmp_path), "split": "validation", "data_dir": None, "limit": None,
           "models": [{"name": "enc", "kernels": ["softmax", "elu", "relu"], "tasks": ["stsb_embedding"]}]}
    # chance: 0 ± 100 / sqrt(99) = 10.05: relu's 9.0 is at chance, elu's 40 is not
    records = [_rec("enc", k, "stsb_embedding", "spearman", v, n=100)
               for k, v in (("softmax", 80.0), ("elu", 40.0), ("relu", 9.0))]
    (tmp_path / "speed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _speed_rows(
        "enc", {"softmax": 1.0, "elu": 1.1, "relu": 0.9})))
    render(cfg, records, [])
    md = (tmp_path / "leaderboard.md").read_text()
    assert "- stsb_embedding: chance 0 ± 10.1" in md and "at chance: enc / relu\n" in md
    assert (tmp_path / "leaderboard_heatmap.png").stat().st_size > 1000
    assert (tmp_path / "leaderboard_speed.png").stat().st_size > 1000  # an encoder alone is plotted too


def test_heartbeat_prints_while_a_step_runs_and_stops_after(monkeypatch, capsys):
    from hf_kernel_attn.leaderboard import progress

    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.05)
    with progress.heartbeat("slow step", lambda: "3/4 forwards"):
        time.sleep(0.4)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3 and all(ln == "slow step: still running (0 s); 3/4 forwards" for ln in lines)
    time.sleep(0.2)
    assert capsys.readouterr().out == ""  # stopped with the block
