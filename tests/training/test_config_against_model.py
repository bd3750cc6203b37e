"""The training config checked against the loaded model when a run starts: every ``layers`` and
``inference_layers`` index and every kernel option (``kernel_params``, per-layer params, ``inference_params``,
``inference_layers``) fails ``finetune`` before the first step, in seconds, with nothing left in the output folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hf_kernel_attn import events
from hf_kernel_attn.training import ConfigError, finetune, load_config
from hf_kernel_attn.training.config_against_model import check_against_model
from tests.conftest import tiny_llama_model
from tests.training.helpers import lm_config, read_log, write_config

CLI = [sys.executable, "-m", "hf_kernel_attn.cli"]
WINDOWED = {"window": 8, "sinks": 2}  # sparse_cache needs a window
RANGE = r"the model has 2 attention layers \(valid indices 0\.\.1, or -2\.\.-1\)"
HEADS = r"head index \[{}\] out of range, the layer has 4 query heads \(valid 0\.\.3\)"


def test_bad_inference_layer_index_fails_finetune_in_seconds_writing_nothing(tiny_llama, tmp_path):
    """The reported command: ``--set "inference_layers={999: {sparse_cache: 4}}"`` used to train every stage and
    fail at the final save; now the CLI exits with the index, its options and the valid range before any step,
    and the output folder (and the folder above it, both new) are gone."""
    out = tmp_path / "runs" / "o"
    cfg = write_config(tmp_path / "c.yaml", lm_config(tiny_llama, out, kernel_params=WINDOWED))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([*CLI, "finetune", str(cfg), "--set", "inference_layers={999: {sparse_cache: 4}}"],
                          capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("error: inference_layers: layer index 999 ({'sparse_cache': 4}) out of range: the model has 2 "
            "attention layers (valid indices 0..1)") in proc.stderr
    assert "--resume" not in proc.stderr and "free on that disk" not in proc.stderr
    assert seconds < 60, seconds
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"inference_layers": {1: {"softmax_heads": [99]}}}, r"^inference_layers\.1: softmax_heads=\[99\]: "
         + HEADS.format(99)),
        ({"inference_layers": {2: {"sinks": 4}}}, r"^inference_layers: layer index 2 \(\{'sinks': 4\}\) out of range: "
         r"the model has 2 attention layers \(valid indices 0\.\.1\)$"),
        ({"inference_params": {"softmax_heads": [4]}}, r"^inference_params \(layer 0\): softmax_heads=\[4\]: "
         + HEADS.format(4)),
        ({"layers": [0, 5]}, r"^layers: layer index 5 in \[0, 5\] out of range: " + RANGE),
        ({"layers": {7: "softmax"}}, r"^layers: layer index 7 \('softmax'\) out of range: " + RANGE),
        ({"layers": {-3: "softmax"}}, r"^layers: layer index -3 \('softmax'\) out of range: " + RANGE),
        ({"layers": {1: {"kernel": "hedgehog", "params": {"softmax_heads": [5]}}}},
         r"^layers\.1: softmax_heads=\[5\]: " + HEADS.format(5)),
        ({"kernel_params": {**WINDOWED, "softmax_heads": [9]}}, r"^kernel_params \(layer 0\): softmax_heads=\[9\]: "
         + HEADS.format(9)),
        # layer 1 keeps softmax (layers: [0]): options for it cannot be saved
        ({"layers": [0], "inference_layers": {1: {"sinks": 4}}},
         r"^inference_layers: layer options for layer 1: it runs 'softmax'"),
    ],
    ids=["inference-heads", "inference-index", "inference-params-heads", "layers-list", "layers-dict",
         "layers-negative", "layers-params", "kernel-params-heads", "inference-softmax-layer"],
)
def test_bad_index_or_option_fails_before_the_first_step(tiny_llama, tmp_path, extra, message):
    """Each bad index or option fails finetune with a ConfigError (a ValueError) naming the key, the index or
    option, the value and the valid range, before any step runs; an output folder that did not exist is not
    created, and one that existed empty stays empty."""
    existing = tmp_path / "existing"
    existing.mkdir()
    for out in (tmp_path / "new", existing):
        cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(tiny_llama, out, **{
            "kernel_params": WINDOWED, **extra})))
        points: list[str] = []
        stop = events.listen(lambda name, _seen=points, **info: _seen.append(name))
        t0 = time.perf_counter()
        try:
            with pytest.raises(ConfigError, match=message):
                finetune(cfg)
        finally:
            stop()
        assert time.perf_counter() - t0 < 60
        assert points == []  # no step began, no log line, no checkpoint, no final save
    assert not (tmp_path / "new").exists()
    assert list(existing.iterdir()) == []


def test_check_against_model_accepts_the_valid_choices():
    """Valid indices (negative ones too) and options pass and give the per-layer choice training starts from; a
    kernel whose constructor reads tensor values (DiJiang) is checked as well (built on the CPU, not the meta
    device)."""
    from hf_kernel_attn.training.config import defaults

    model = tiny_llama_model()
    config = {**defaults(), "kernel": "hedgehog", "kernel_params": dict(WINDOWED),
              "layers": {-1: {"kernel": "hedgehog", "params": {**WINDOWED, "softmax_heads": [3]}}},
              "inference_params": {"sparse_cache": 4}, "inference_layers": {0: {"softmax_heads": [0, 1]}}}
    kcfg = check_against_model(config, model)
    assert kcfg.for_layer(1).params["softmax_heads"] == [3] and kcfg.for_layer(0).params == WINDOWED
    assert check_against_model({**defaults(), "kernel": "dijiang"}, model).kernel == "dijiang"
    with pytest.raises(ValueError, match=r"^inference_layers\.0: softmax_heads=\[4\]"):
        check_against_model({**config, "inference_layers": {0: {"softmax_heads": [4]}}}, model)


def test_inference_layers_for_a_layer_auto_keeps_as_softmax_fail_at_the_choice(tiny_llama, tmp_path):
    """layers: auto:1 with options for both layers: which layer stays softmax is known after attention transfer
    only; the run stops there (before the next stage and the final save), naming the layer and the choice."""
    out = tmp_path / "o"
    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(
        tiny_llama, out, layers="auto:1", kernel_params=WINDOWED, inference_layers={0: {"sinks": 4}, 1: {"sinks": 4}},
        **{"stages.transfer.steps": 2, "stages.lora.steps": 2})))
    with pytest.raises(ConfigError, match=r"^inference_layers: layer options for layer [01]: it runs 'softmax'.*"
                                          r"\(layers: auto:1 keeps layers \[[01]\] as softmax"):
        finetune(cfg)
    assert {r["stage"] for r in read_log(out)} == {"transfer"} and not (out / "final").exists()
