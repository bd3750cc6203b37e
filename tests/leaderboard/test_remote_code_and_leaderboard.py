"""A saved kernel model in tools that never import the plugin (trust_remote_code), and the
resumable leaderboard sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import hf_kernel_attn
from tests.compat import CONFIG_KEEPS_ATTN
from tests.paths import DATA

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def saved_hedgehog(tiny_llama, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf_kernel_attn.patch(model, kernel="hedgehog", layers=[1])
    with torch.no_grad():  # off the identity init, so a loader that drops the kernel state is caught
        model.model.layers[1].self_attn.kernel_attn.weight_q.add_(0.3)
    path = tmp_path_factory.mktemp("saved_hedgehog")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        logits = model(ids).logits
    return path, ids, logits


def test_trust_remote_code_runs_the_kernel_without_importing_the_plugin(saved_hedgehog, tmp_path):
    path, ids, logits = saved_hedgehog
    torch.save({"ids": ids, "logits": logits}, tmp_path / "expected.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
assert "hf_kernel_attn" not in sys.modules
m = AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True).eval()
exp = torch.load({str(tmp_path / 'expected.pt')!r})
with torch.no_grad():
    got = m(exp["ids"]).logits
print(type(m.model.layers[1].self_attn.kernel_attn).__name__, float((got - exp["logits"]).abs().max()))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, diff = proc.stdout.split()[-2:]
    assert name == "HedgehogKernel" and float(diff) == 0.0
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "hf_kernel_attn_model.KernelAttnLlamaForCausalLM"


@pytest.mark.skipif(not CONFIG_KEEPS_ATTN, reason="this transformers ignores config.json's attn_implementation: the "
                    "saved-model marker cannot stop a plain load")
def test_without_trust_remote_code_the_error_stays(saved_hedgehog):
    path = saved_hedgehog[0]
    script = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV)
    assert proc.returncode != 0 and "import hf_kernel_attn before loading" in proc.stderr


def test_stock_lm_eval_with_remote_code_equals_our_eval(saved_hedgehog, tmp_path):
    """`lm_eval --model hf ... trust_remote_code=True` (no plugin import in the command) gives the
    numbers of `hf-kernel-attn eval` on the same local task."""
    from hf_kernel_attn.evaluation.lm_eval_tasks import local_task_dir
    from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval

    path = saved_hedgehog[0]
    records = run_eval(ModelSpec(str(path)), ["arc_easy"], EvalSettings(data_dir=DATA, limit=6))
    ours = {r["metric"]: r["value"] for r in records}
    tasks = local_task_dir(["arc_easy"], DATA, "validation", tmp_path / "tasks")
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={path},trust_remote_code=True",
         "--tasks", "arc_easy", "--include_path", str(tasks), "--limit", "6", "--output_path", str(tmp_path / "o")],
        capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = json.loads(sorted((tmp_path / "o").rglob("results_*.json"))[-1].read_text())["results"]["arc_easy"]
    assert stock["acc,none"] == pytest.approx(ours["acc"], abs=1e-9)
    assert stock["acc_norm,none"] == pytest.approx(ours["acc_norm"], abs=1e-9)


def _leaderboard_config(tmp_path, tiny_llama, tiny_bert) -> Path:
    cfg = {
        "output_dir": str(tmp_path / "lb"), "data_dir": str(DATA), "context": 64, "speed": {"length": 32, "repeats": 2},
        "limit": {"wikitext2": 2, "arc_easy": 3, "piqa": 3, "stsb_embedding": 12},
        "models": [
            {"name": "tiny-llama", "model": str(tiny_llama), "kernels": ["softmax", "elu", "gaussian"],
             "kernel_params": {"gaussian": {"projection": "diagonal"}}, "tasks": ["wikitext2", "arc_easy", "piqa"]},
            {"name": "tiny-bert", "model": str(tiny_bert), "kernels": ["softmax", "elu"], "tasks": ["stsb_embedding"]},
        ],
    }
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _results(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow(30)
def test_leaderboard_renders_skips_and_resumes(tiny_llama, tiny_bert, tmp_path):
    config = _leaderboard_config(tmp_path, tiny_llama, tiny_bert)
    out = tmp_path / "lb"
    cmd = [sys.executable, "-m", "hf_kernel_attn.cli", "leaderboard", str(config)]
    # kill the first sweep after its first finished cell, then resume
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.endswith(": done\n"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    partial = _results(out)
    assert partial and not (out / "leaderboard.md").exists()
    first = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    records = _results(out)
    cells = [(r["model_name"], r["kernel_row"], r["task"], r["metric"]) for r in records]
    assert len(cells) == len(set(cells))  # nothing computed twice
    assert records[: len(partial)] == partial  # the killed sweep's cells were kept, not recomputed
    assert {c[:3] for c in cells} == {
        *{("tiny-llama", k, t) for k in ("softmax", "elu", "gaussian") for t in ("wikitext2", "arc_easy")},
        ("tiny-bert", "softmax", "stsb_embedding"), ("tiny-bert", "elu", "stsb_embedding")}
    table = (out / "leaderboard.md").read_text()
    assert "| tiny-llama | elu |" in table and "error" in table  # piqa has no local validation file
    csv_lines = (out / "leaderboard.csv").read_text().splitlines()
    assert csv_lines[0] == "model,kernel,task,metric,value,stderr,n,split,cache_bytes" and len(csv_lines) == 1 + 8
    assert (out / "leaderboard_heatmap.png").stat().st_size > 1000
    assert (out / "leaderboard_speed.png").stat().st_size > 1000
    # the speed plot's timings: one interleaved benchmark per model (never the evaluation's own timings)
    speed = [json.loads(ln) for ln in (out / "speed.jsonl").read_text().splitlines()]
    assert {(r["model"], r["kernel"]) for r in speed} == {
        ("tiny-llama", "softmax"), ("tiny-llama", "elu"), ("tiny-llama", "gaussian"),
        ("tiny-bert", "softmax"), ("tiny-bert", "elu")}
    assert all(r["length"] == 32 and r["status"] == "ok" for r in speed)
    assert [r["ratio_vs_softmax"] for r in speed if r["kernel"] == "softmax"] == [1.0, 1.0]
    errors = [json.loads(ln) for ln in (out / "errors.jsonl").read_text().splitlines()]
    assert {e["task"] for e in errors} == {"piqa"} and "valid.jsonl" in errors[0]["error"]
    # a second run computes nothing
    second = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert second.returncode == 0
    assert _results(out) == records
    assert not [ln for ln in second.stdout.splitlines() if ln.endswith((": done", "benchmark done")) or "failed" in ln]


def test_leaderboard_config_errors(tmp_path):
    from hf_kernel_attn.leaderboard.config import load_leaderboard_config

    def write(cfg):
        p = tmp_path / "c.yaml"
        p.write_text(yaml.safe_dump(cfg))
        return p

    base = {"output_dir": str(tmp_path), "models": [{"name": "m", "model": "x", "kernels": ["softmax"],
                                                      "tasks": ["wikitext2"]}]}
    with pytest.raises(ValueError, match="unknown leaderboard key"):
        load_leaderboard_config(write({**base, "modles": []}))
    with pytest.raises(ValueError, match="unknown kernel"):
        load_leaderboard_config(write({**base, "models": [{**base["models"][0], "kernels": ["gauss"]}]}))
    with pytest.raises(ValueError, match="unknown task"):
        load_leaderboard_config(write({**base, "models": [{**base["models"][0], "tasks": ["wiki"]}]}))
    with pytest.raises(ValueError, match="needs 'model'"):
        load_leaderboard_config(write({**base, "models": [{"name": "m", "kernels": ["softmax"], "tasks": ["ptb"]}]}))
    with pytest.raises(ValueError, match="does not exist"):
        load_leaderboard_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"unknown leaderboard speed key\(s\) 'lenght' \(did you mean 'length'"):
        load_leaderboard_config(write({**base, "speed": {"lenght": 64}}))
    with pytest.raises(ValueError, match="speed.repeats must be an integer >= 1"):
        load_leaderboard_config(write({**base, "speed": {"repeats": 0}}))


def test_heat_map_colours_zero_scores():
    """A 0 score is the bottom colour of the heat map (log2 0 = -inf used to render as a blank cell); missing
    cells stay blank; other cells are log2 of the ratio (math.log2 as the reference)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from hf_kernel_attn.leaderboard.plots import HEAT_RANGE, heat_values

    ratios = np.array([[0.0, 0.5, 1.0], [1.7, np.nan, 40.0]])
    values = heat_values(ratios)
    assert values[0, 0] == -HEAT_RANGE and values[1, 2] == HEAT_RANGE and np.isnan(values[1, 1])
    for r, v in ((0.5, values[0, 1]), (1.0, values[0, 2]), (1.7, values[1, 0])):
        assert v == pytest.approx(math.log2(r))
    fig, ax = plt.subplots()
    im = ax.imshow(values, cmap="RdYlGn", vmin=-HEAT_RANGE, vmax=HEAT_RANGE)
    rgba = im.to_rgba(im.get_array())
    plt.close(fig)
    bottom = matplotlib.colormaps["RdYlGn"](0.0)
    assert tuple(rgba[0, 0]) == pytest.approx(bottom)  # coloured, the worst colour
    assert rgba[1, 1][3] == 0.0  # a missing cell is transparent (blank)


def test_leaderboard_prints_progress_in_every_phase(tiny_llama, tiny_bert, tmp_path, monkeypatch, capsys):
    """Each cell says when it starts and what it scored, the speed benchmark each (model, kernel) it timed (the
    encoder too), the plots where they went; a phase running longer than HEARTBEAT_SECONDS prints a heartbeat."""
    from hf_kernel_attn.leaderboard import progress, runner

    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.25)
    cfg = {"output_dir": str(tmp_path / "lb"), "data_dir": str(DATA), "context": 32, "jobs": 1,
           "speed": {"length": 16, "repeats": 1}, "limit": {"wikitext2": 1, "stsb_embedding": 8},
           "models": [{"name": "tiny-llama", "model": str(tiny_llama), "kernels": ["softmax", "elu"],
                       "tasks": ["wikitext2"]},
                      {"name": "tiny-bert", "model": str(tiny_bert), "kernels": ["softmax"],
                       "tasks": ["stsb_embedding"]}]}
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runner.leaderboard(path)
    out = capsys.readouterr().out.splitlines()

    def index(prefix: str) -> int:
        found = [i for i, ln in enumerate(out) if ln.startswith(prefix)]
        assert found, f"no line starting {prefix!r} in:\n" + "\n".join(out)
        return found[0]

    assert index("leaderboard: 3 cell(s) of 3 row(s) to evaluate") == 0
    for label, metric in (("tiny-llama softmax wikitext2", "perplexity"), ("tiny-llama elu wikitext2", "perplexity"),
                          ("tiny-bert softmax stsb_embedding", "spearman")):
        assert index(f"{label}: evaluating") < index(f"{label}: {metric} ") < index(f"{label}: done")
    timed = [index(f"speed {m} {k}: ") for m, k in (("tiny-llama", "softmax"), ("tiny-llama", "elu"),
                                                     ("tiny-bert", "softmax"))]
    assert index("speed: timing 2 model(s)") < min(timed)
    assert all(" ms per forward, " in out[i] for i in timed)
    assert index("plots: wrote") > max(timed)
    assert any(": still running (" in ln for ln in out)  # the heartbeat, every 0.25 s here
