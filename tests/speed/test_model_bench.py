"""`hf-kernel-attn bench --model`: whole-model forward ratios per kernel (hf_kernel_attn.speed.model_bench)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from hf_kernel_attn.cli import main
from hf_kernel_attn.speed.model_bench import (
    Rounds,
    bench_models,
    format_model_table,
    load_models,
    make_inputs,
)


def test_encoder_rows_and_interleaved_ratios(tiny_bert):
    models, kind = load_models(str(tiny_bert), kernels=["softmax", "elu", "skyformer"])
    assert kind == "embedding"
    rows = bench_models(models, kind, batches=[3], lengths=[10], rounds=Rounds(repeats=3, warmup=0))
    assert [(r["kernel"], r["batch"], r["length"]) for r in rows] == [
        ("softmax", 3, 10), ("elu", 3, 10), ("skyformer", 3, 10)]
    base = rows[0]
    for r in rows:
        assert r["status"] == "ok" and len(r["times_s"]) == 3
        assert r["time_s"] == statistics.median(r["times_s"])
        # the ratio is the median over rounds of (kernel / softmax in the same round)
        expected = statistics.median(t / b for t, b in zip(r["times_s"], base["times_s"], strict=True))
        assert r["ratio_vs_softmax"] == pytest.approx(expected)
    assert base["ratio_vs_softmax"] == 1.0
    assert rows[0]["tokens"] == 5 + 8 + 10  # ragged right padding: lengths 5, 7.5 -> 8, 10
    table = format_model_table(rows)
    assert "| elu |" in table and "3×10" in table


def test_models_are_patched_copies(tiny_llama):
    models, kind = load_models(str(tiny_llama), kernels=["elu", "skyformer"])
    assert kind == "causal_lm"
    assert models["skyformer"] is None  # bidirectional only: recorded as skipped
    assert models["elu"].config.kernel_attention["kernel"] == "elu"
    assert getattr(models["softmax"].config, "kernel_attention", None) is None
    ids = make_inputs(kind, 100, 2, 12)
    assert bool(ids["attention_mask"].all())  # decoder prompts: unpadded
    with torch.no_grad():
        a = models["softmax"](**ids).logits
        b = models["elu"](**ids).logits
    assert not torch.allclose(a, b)  # really a different kernel, not a shared module
    rows = bench_models(models, kind, batches=[1], lengths=[8], rounds=Rounds(repeats=1, warmup=0))
    sky = next(r for r in rows if r["kernel"] == "skyformer")
    assert sky["status"] == "skipped" and "bidirectional" in sky["reason"]


def test_cli_model_mode_writes_json(tiny_bert, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(tiny_bert), "--kernels", "softmax", "hedgehog", "--batch-sizes", "2",
               "--lengths", "6", "9", "--repeats", "2", "--threads", "1", "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["settings"]["kind"] == "embedding" and data["settings"]["lengths"] == [6, 9]
    assert {(r["kernel"], r["length"]) for r in data["rows"]} == {
        ("softmax", 6), ("hedgehog", 6), ("softmax", 9), ("hedgehog", 9)}
    assert "x softmax" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kernels", "gauss"], "unknown kernel"),
        (["--batch-sizes", "0"], "must be >= 1"),
        (["--model-kind", "vision"], "invalid choice"),
    ],
)
def test_cli_model_mode_errors(tiny_bert, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", str(tiny_bert), *argv])
    assert message in str(exc.value.code) + capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--model", str(tmp_path / "nope"), "--kernels", "elu"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --model") and "nope" in line and "does not exist" in line
