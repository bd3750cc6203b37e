"""A ``kernels:`` item ``{press: NAME, compression: R}`` (or ``press_bytes: B``) in a leaderboard config: a row of
the unconverted model whose long-context contexts a kvpress press compresses, labelled ``softmax+NAME@R``; the
config's checks (each naming the bad key and the valid choices), the sweep's up-front refusal without kvpress
(before any row converts or loads), and, where kvpress runs, a tiny sweep on SmolLM2 whose row carries the press,
its compression and the cache bytes."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import time

import pytest
import yaml

from hf_kernel_attn.cli import main
from hf_kernel_attn.evaluation.presses import require_kvpress
from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec
from hf_kernel_attn.leaderboard import runner
from hf_kernel_attn.leaderboard.config import PressUnavailableError, load_leaderboard_config, press_row
from hf_kernel_attn.leaderboard.workers import converts, eval_in_interpreter


def _write(tmp_path, models, **top):
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "lb"), "data_dir": None, "lengths": [128],
                                    "depths": [50], "samples": 1, "models": models, **top}))
    return path


def _entry(*press_items, tasks=("passkey",), **kw):
    return {"name": "m", "model": "some/model", "kernels": ["softmax", *press_items], "tasks": list(tasks), **kw}


def test_press_rows_are_labelled_and_carry_their_settings(tmp_path):
    cfg = load_leaderboard_config(_write(tmp_path, [_entry(
        {"press": "snapkv", "compression": 0.9}, {"press": "streaming_llm", "press_bytes": 9437184},
        {"press": "knorm", "compression": 0.5, "label": "knorm-half"}, tasks=("passkey", "niah"))]))
    m = cfg["models"][0]
    assert m["kernels"] == ["softmax", "softmax+snapkv@0.9", "softmax+streaming_llm@9MiB", "knorm-half"]
    assert press_row(m, "softmax+snapkv@0.9") == {"press": "snapkv", "compression": 0.9, "press_bytes": None}
    assert press_row(m, "softmax+streaming_llm@9MiB") == {"press": "streaming_llm", "compression": None,
                                                          "press_bytes": 9437184}
    assert press_row(m, "softmax") is None and not converts(m, "softmax+snapkv@0.9")
    cfg = load_leaderboard_config(_write(tmp_path, [_entry()]),
                                  overrides=["models.0.kernels=[softmax,{press: tova, compression: 0.25}]"])
    assert cfg["models"][0]["kernels"] == ["softmax", "softmax+tova@0.25"]


@pytest.mark.parametrize(("item", "entry", "match"), [
    ({"press": "nope", "compression": 0.5}, {}, r"press: .*'nope'.*snapkv.*streaming_llm"),
    ({"compression": 0.5}, {}, r"needs press: NAME, one of \[.*'snapkv'"),
    ({"press": "snapkv"}, {}, "needs one of compression .* and press_bytes"),
    ({"press": "snapkv", "compression": 0.5, "press_bytes": 100}, {}, "needs one of compression .* and press_bytes"),
    ({"press": "snapkv", "compression": 1.0}, {}, r"compression must be in \[0, 1\), got 1\.0"),
    ({"press": "snapkv", "press_bytes": 0}, {}, "press_bytes must be an integer >= 1, got 0"),
    ({"press": "snapkv", "compresion": 0.5}, {}, r"'compresion' \(did you mean 'compression'\?\).*valid: \["),
    ({"press": "snapkv", "compression": 0.5, "kernel": "elu"}, {}, r"unconverted softmax model.*drop \['kernel'\]"),
    ({"press": "snapkv", "compression": 0.5}, {"finetune": "x/{kernel}.yaml"}, "entry without finetune"),
    ({"press": "snapkv", "compression": 0.5}, {"tasks": ["passkey", "wikitext2"]},
     r"long-context tasks .*'passkey', 'niah', 'kv_recall'.*not \['wikitext2'\]"),
    ({"press": "snapkv", "compression": 0.5, "label": "elu"}, {}, "label 'elu' must be a new row name"),
])
def test_bad_press_rows_name_the_problem(tmp_path, item, entry, match):
    with pytest.raises(ValueError, match=match):
        load_leaderboard_config(_write(tmp_path, [{**_entry(item), **entry}]))


def test_one_label_means_one_press_across_entries(tmp_path):
    items = [{"press": "snapkv", "compression": 0.5, "label": "p"}, {"press": "tova", "compression": 0.5, "label": "p"}]
    with pytest.raises(ValueError, match="press row 'p' is declared twice"):
        load_leaderboard_config(_write(tmp_path, [_entry(items[0]), _entry(items[1], tasks=("niah",))]))


def test_a_sweep_with_a_press_row_fails_up_front_without_kvpress(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))
    started = []
    monkeypatch.setattr(runner, "evaluate_row", lambda *a: started.append(a))
    monkeypatch.setattr(runner, "evaluate_rows_in_workers", lambda *a: started.append(a))
    path = _write(tmp_path, [_entry({"press": "snapkv", "compression": 0.5}),
                             {**_entry(), "kernels": ["softmax", "elu"], "finetune": "nope/{kernel}.yaml"}])
    cfg = load_leaderboard_config(path)  # the config itself is fine without kvpress
    with pytest.raises(ImportError, match=r"pip install 'hf_kernel_attn\[press\]'"):
        runner.run_leaderboard(cfg)
    assert main(["leaderboard", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install 'hf_kernel_attn[press]'" in err and "transformers" in err
    assert started == [] and not (tmp_path / "lb" / "models").exists()
    with pytest.raises(PressUnavailableError):  # both an ImportError and a ValueError (the command's error: line)
        runner.run_leaderboard(load_leaderboard_config(path, overrides=["jobs=2"]))
    assert started == []


def _kvpress_usable() -> bool:
    try:
        require_kvpress()
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _kvpress_usable(), reason="kvpress is not installed here (or transformers is outside its pin)")
@pytest.mark.slow(60)
def test_a_press_row_sweeps_passkey_on_smollm2(smollm2_dir, tmp_path):
    path = _write(tmp_path, [{"name": "smollm2", "model": str(smollm2_dir), "tasks": ["passkey"],
                              "kernels": [{"press": "snapkv", "compression": 0.5}]}])
    table = runner.leaderboard(path)
    assert table["rows"] == [("smollm2", "softmax+snapkv@0.5")]
    records = [json.loads(ln) for ln in (tmp_path / "lb" / "results.jsonl").read_text().splitlines()]
    main_records = [r for r in records if r["metric"] == "accuracy" or r["task"] == "passkey"]
    assert main_records and all(r["kernel_row"] == "softmax+snapkv@0.5" and r["kernel"] == "softmax" for r in records)
    for r in records:
        assert r["press"] == "snapkv" and r["press_bytes"] is None and r["cache_bytes"] > 0
        assert r["compression"] == pytest.approx(0.5, abs=0.02)
    assert "softmax+snapkv@0.5" in table["markdown"] and "iB)" in table["markdown"]
    csv_lines = (tmp_path / "lb" / "leaderboard.csv").read_text().splitlines()
    assert csv_lines[0].endswith(",cache_bytes") and csv_lines[1].split(",")[-1] == str(records[0]["cache_bytes"])


def test_press_python_must_run_kvpress_before_any_row_loads(tmp_path, monkeypatch):
    """press_python: where kvpress is missing here, the press rows run in that interpreter; one that cannot run, or
    lacks kvpress, stops the sweep up front, naming it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))
    started = []
    monkeypatch.setattr(runner, "evaluate_row", lambda *a: started.append(a))
    entry = _entry({"press": "snapkv", "compression": 0.5})
    missing = str(tmp_path / "no-such-venv" / "bin" / "python")
    with pytest.raises(PressUnavailableError, match="press_python .*no-such-venv.* cannot run"):
        runner.run_leaderboard(load_leaderboard_config(_write(tmp_path, [entry], press_python=missing)))
    fake = tmp_path / "python-without-kvpress"
    fake.write_text("#!/bin/sh\necho 'ImportError: no kvpress in this one' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(PressUnavailableError, match="nor in press_python .*no kvpress in this one"):
        runner.run_leaderboard(load_leaderboard_config(_write(tmp_path, [entry], press_python=str(fake))))
    assert started == []
    with pytest.raises(ValueError, match="press_python must be null or the path of a Python interpreter"):
        load_leaderboard_config(_write(tmp_path, [entry], press_python=3))


@pytest.mark.skipif(not _kvpress_usable(), reason="kvpress is not installed here (or transformers is outside its pin)")
@pytest.mark.slow(60)
def test_a_press_row_in_another_interpreter_records_what_it_does_here(smollm2_dir, tmp_path, monkeypatch):
    """The same press row run in this process and through press_python (here: this interpreter, in a subprocess,
    as a second environment would run it) gives the same records."""
    import sys

    from hf_kernel_attn.leaderboard import workers

    entry = {"name": "smollm2", "model": str(smollm2_dir), "tasks": ["passkey"],
             "kernels": [{"press": "snapkv", "press_bytes": 4_000_000}]}
    here = runner.leaderboard(_write(tmp_path, [entry]))
    monkeypatch.setattr(workers, "press_here", lambda cfg: False)
    there_dir = tmp_path / "there"
    there_dir.mkdir()
    there = runner.leaderboard(_write(there_dir, [entry], press_python=sys.executable))
    assert here["markdown"] == there["markdown"]

    def records(folder):
        keep = ("kernel_row", "task", "metric", "value", "length", "depth", "cache_bytes", "compression", "press")
        return [{k: r[k] for k in keep} for r in map(json.loads, (folder / "lb" / "results.jsonl").read_text()
                                                      .splitlines())]
    assert records(tmp_path) == records(there_dir) and records(tmp_path)


def test_a_press_cell_that_never_finishes_is_stopped_and_named(tmp_path):
    """A press cell whose interpreter never returns (lm-eval's RULER vt builder at a length no prompt fits loops for
    ever and catches every exception) is killed after the timeout: a RuntimeError naming the task, no process left."""
    pid_file = tmp_path / "pid"
    python = tmp_path / "python"  # an interpreter that, like that builder, never finishes
    python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 100000\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    settings = EvalSettings(split="validation", data_dir=None, limit=1, lengths=[256], depths=[50], samples=1,
                            press="streaming_llm", compression=0.5)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="for ruler_vt and was stopped after 2 s"):
        eval_in_interpreter(str(python), ModelSpec("some/model", None, None, None, {}), "ruler_vt", settings,
                            timeout=2)
    assert time.perf_counter() - start < 30
    pid = int(pid_file.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
