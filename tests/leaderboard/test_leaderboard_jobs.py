"""`leaderboard --jobs 2`: the conversions run in another process while this one evaluates the untrained rows;
the table is the one a single process makes, and a failing conversion is an error cell, not a crash."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from hf_kernel_attn.cli import main
from tests.paths import DATA


def _board(tmp_path: Path, minilm_dir: Path, name: str, finetune: str) -> Path:
    board = {"output_dir": str(tmp_path / name), "data_dir": str(DATA), "limit": {"stsb_embedding": 24},
             "speed": None,
             "models": [{"name": "minilm", "model": str(minilm_dir), "kernels": ["softmax", "elu"],
                         "tasks": ["stsb_embedding"]},
                        {"name": "minilm (converted)", "model": str(minilm_dir), "kernels": ["gaussian"],
                         "tasks": ["stsb_embedding"], "finetune": finetune}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(board))
    return path


def _cells(folder: Path) -> dict[tuple[str, str], float]:
    rows = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines()]
    return {(r["model_name"], r["kernel_row"]): r["value"] for r in rows}


@pytest.mark.slow(30)
@pytest.mark.real_model
def test_jobs_2_converts_beside_the_evaluation_and_gives_the_same_table(minilm_dir, tmp_path, capfd, monkeypatch):
    train = {"model": str(minilm_dir), "task": "sentence_embedding", "kernel": "gaussian",
             "kernel_params": {"projection": "full"},
             "data": {"train": [str(DATA / "stsb" / "train.tsv")], "glue_task": "stsb", "seq_len": 32,
                      "batch_size": 8, "validation_batches": 1, "max_train_chars": 20000},
             "stages": {"transfer": {"steps": 3, "lr": 1.0e-2}, "full": {"steps": 3, "lr": 1.0e-4}},
             "seed": 0, "threads": 1, "save_every": 0, "output_dir": "unused"}
    (tmp_path / "convert-gaussian.yaml").write_text(yaml.safe_dump(train))
    finetune = str(tmp_path / "convert-{kernel}.yaml")
    from hf_kernel_attn.training import trainer

    monkeypatch.setattr(trainer, "PROGRESS_SECONDS", 0.0)  # in this process: a progress line after every step
    assert main(["leaderboard", str(_board(tmp_path, minilm_dir, "one", finetune))]) == 0
    one_out = capfd.readouterr().out.splitlines()
    for stage in ("transfer", "full"):
        assert [ln.split(",")[0] for ln in one_out if ln.startswith(f"{stage}: step ")] == [
            f"{stage}: step {i}/3 (run step {i + 3 * (stage == 'full')})" for i in (1, 2, 3)]
    threads = __import__("torch").get_num_threads()
    assert main(["leaderboard", "--jobs", "2", str(_board(tmp_path, minilm_dir, "two", finetune))]) == 0
    # the worker's lines reach this process's stdout (fd 1, shared): the conversion's start, its first and last
    # steps (every 30 s between), the evaluation of its row
    two_out = capfd.readouterr().out.splitlines()
    for line in ("minilm (converted) gaussian: row started in worker process", "minilm (converted) gaussian: "
                 "conversion: starting", "transfer: step 1/3", "transfer: step 3/3", "full: step 3/3",
                 "minilm (converted) gaussian: conversion: finished", "minilm (converted) gaussian stsb_embedding: "
                 "spearman ", "minilm elu stsb_embedding: evaluating"):
        assert any(ln.startswith(line) for ln in two_out), f"{line!r} not in:\n" + "\n".join(two_out)
    assert __import__("torch").get_num_threads() == threads  # the worker's thread count does not leak
    one, two = _cells(tmp_path / "one"), _cells(tmp_path / "two")
    assert set(one) == set(two) == {("minilm", "softmax"), ("minilm", "elu"), ("minilm (converted)", "gaussian")}
    assert two == pytest.approx(one, abs=1e-6)
    assert one[("minilm (converted)", "gaussian")] != one[("minilm", "softmax")]  # it did run the trained model
    for name in ("one", "two"):  # each run converted its own model
        log = tmp_path / name / "models" / "minilm (converted)-gaussian" / "training_log.jsonl"
        assert len(log.read_text().splitlines()) >= 6
    # a conversion that fails in the worker: that row's cells are errors, the others are scored
    board = _board(tmp_path, minilm_dir, "bad", str(tmp_path / "missing-{kernel}.yaml"))
    assert main(["leaderboard", "--jobs", "2", str(board)]) == 0
    errors = [json.loads(x) for x in (tmp_path / "bad" / "errors.jsonl").read_text().splitlines()]
    assert [(e["model_name"], e["kernel_row"]) for e in errors] == [("minilm (converted)", "gaussian")]
    assert "missing-gaussian.yaml" in errors[0]["error"]
    assert set(_cells(tmp_path / "bad")) == {("minilm", "softmax"), ("minilm", "elu")}
    capfd.readouterr()


@pytest.mark.parametrize("jobs", ["0", "two"])
def test_bad_jobs_is_a_clear_error(tmp_path, minilm_dir, jobs, capsys):
    board = _board(tmp_path, minilm_dir, "x", "none-{kernel}.yaml")
    text = board.read_text() + f"jobs: {jobs}\n"
    board.write_text(text)
    assert main(["leaderboard", str(board)]) == 2
    assert "jobs must be an integer >= 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.slow(40)
@pytest.mark.real_model
def test_killed_sweep_takes_its_workers_with_it(minilm_dir, tmp_path):
    """SIGKILL of `leaderboard --jobs 2` while a worker converts: the worker dies too (no orphan writing into
    the conversion folder that a re-run would resume)."""
    import signal
    import subprocess
    import sys
    import time

    train = {"model": str(minilm_dir), "task": "sentence_embedding", "kernel": "gaussian",
             "data": {"train": [str(DATA / "stsb" / "train.tsv")], "glue_task": "stsb", "seq_len": 32,
                      "batch_size": 8, "validation_batches": 1, "max_train_chars": 20000},
             "stages": {"transfer": {"steps": 400, "lr": 1.0e-3}}, "seed": 0, "threads": 1, "save_every": 0,
             "output_dir": "unused"}
    (tmp_path / "slow-gaussian.yaml").write_text(yaml.safe_dump(train))
    board = _board(tmp_path, minilm_dir, "killed", str(tmp_path / "slow-{kernel}.yaml"))
    proc = subprocess.Popen([sys.executable, "-m", "hf_kernel_attn.cli", "leaderboard", "--jobs", "2", str(board)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = tmp_path / "killed" / "models" / "minilm (converted)-gaussian" / "training_log.jsonl"
    deadline = time.time() + 240
    while not (log.exists() and log.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.5)
    assert log.exists(), "the conversion never started"
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                              text=True).stdout.split()]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(3)
    size = log.stat().st_size
    time.sleep(3)
    assert log.stat().st_size == size  # nothing writes into the conversion folder any more
    alive = [p for p in workers if os.path.exists(f"/proc/{p}") and "Z" not in
             Path(f"/proc/{p}/stat").read_text().split()[2]]
    assert workers and not alive


def test_a_row_loads_its_model_once_and_scores_each_task_as_a_fresh_load_does(tiny_llama, tmp_path, monkeypatch):
    """A leaderboard row keeps its model across its tasks (one load per row, not per cell); every cell's records
    equal those of `run_eval` on a freshly loaded model for that task alone (a task leaves nothing behind in the
    model that changes the next one's numbers)."""
    from hf_kernel_attn.evaluation import runner
    from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval

    loads = []
    original = runner.ModelSpec.load

    def counting(self, kind):
        loads.append((self.kernel, kind))
        return original(self, kind)

    monkeypatch.setattr(runner.ModelSpec, "load", counting)
    tasks = ["wikitext2", "arc_easy", "passkey"]
    config = {"output_dir": str(tmp_path / "lb"), "data_dir": str(DATA), "limit": 2, "context": 64,
              "lengths": [128], "depths": [50], "samples": 1,
              "models": [{"name": "tiny", "model": str(tiny_llama), "kernels": ["softmax", "elu"], "tasks": tasks}]}
    (tmp_path / "lb.yaml").write_text(yaml.safe_dump(config))
    assert main(["leaderboard", str(tmp_path / "lb.yaml")]) == 0
    assert sorted(loads) == [("elu", "causal_lm"), ("softmax", "causal_lm")]  # one load per row
    rows = [json.loads(x) for x in (tmp_path / "lb" / "results.jsonl").read_text().splitlines()]
    drop = ("seconds", "model_name", "kernel_row", "decode_ms_per_token")
    for kernel in ("softmax", "elu"):
        for task in tasks:
            spec = ModelSpec(str(tiny_llama), None, kernel)
            fresh = run_eval(spec, [task], EvalSettings(data_dir=DATA, limit=2, context=64, lengths=[128],
                                                        depths=[50], samples=1))
            got = [r for r in rows if r["kernel_row"] == kernel and r["task"] == task]
            a = [{k: v for k, v in r.items() if k not in drop} for r in got]
            b = [{k: v for k, v in r.items() if k not in drop} for r in fresh]
            assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), (kernel, task)  # NaN == NaN
