"""scripts/save_inference_variant.py: a converted folder saved again with another finetune config's inference
options: the same tensors, the options in the kernel choice of the model loaded from it (not read from the
file written), and refusals that name the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import hf_kernel_attn
from hf_kernel_attn.integration.patching import kernel_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "save_inference_variant.py"


def _config(tmp_path, model, **extra) -> Path:
    cfg = {"model": str(model), "task": "causal_lm", "kernel": "hedgehog", "kernel_params": {"window": 8, "sinks": 2},
           "data": {"train": [str(tmp_path / "t.txt")], "seq_len": 32}, "output_dir": str(tmp_path / "out"),
           "stages": {"transfer": {"steps": 1}}, **extra}
    (tmp_path / "t.txt").write_text("some text\n" * 50)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_the_variant_holds_the_same_tensors_and_the_configs_options(tiny_llama, tmp_path):
    trained = tmp_path / "trained"
    model = hf_kernel_attn.from_pretrained(tiny_llama, kernel="hedgehog", kernel_params={"window": 8, "sinks": 2})
    with torch.no_grad():
        model.model.layers[1].self_attn.kernel_attn.weight_q.add_(0.3)  # off the init: the copy must carry it
    model.save_pretrained(trained)
    config = _config(tmp_path, tiny_llama, inference_params={"sparse_cache": 4, "sparse_block": 2},
                     inference_layers={1: {"sinks": 3}})
    proc = _run(trained, config)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" / "final"
    assert load_file(out / "model.safetensors").keys() == load_file(trained / "model.safetensors").keys()
    for name, tensor in load_file(trained / "model.safetensors").items():
        assert torch.equal(load_file(out / "model.safetensors")[name], tensor)
    variant = hf_kernel_attn.from_pretrained(out)
    kcfg = kernel_config(variant)
    params = [kcfg.for_layer(i).params for i in range(2)]
    assert params[0] == {"window": 8, "sinks": 2, "sparse_cache": 4, "sparse_block": 2}
    assert params[1] == {"window": 8, "sinks": 3, "sparse_cache": 4, "sparse_block": 2}
    assert _run(trained, config).returncode == 2  # the folder exists now: refused, nothing overwritten


def test_refusals_name_the_problem(tiny_llama, tmp_path):
    config = _config(tmp_path, tiny_llama, inference_params={"sparse_cache": 4})
    proc = _run(tiny_llama, config)
    assert proc.returncode == 2 and "not a converted model" in proc.stderr
    elu = tmp_path / "elu"
    hf_kernel_attn.from_pretrained(tiny_llama, kernel="elu").save_pretrained(elu)
    proc = _run(elu, config)
    assert proc.returncode == 2 and "runs 'elu'" in proc.stderr and "'hedgehog'" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
