"""Damaged checkpoints give one ``error:`` line naming the file, exit code 2, from every command that loads a model
(eval, bench --model, decode-bench, leaderboard; its worker processes too): a truncated or garbage
model.safetensors, a truncated pytorch_model.bin, a shard of a sharded checkpoint, and weights whose shapes differ
from what config.json builds. Each checkpoint is a tiny random Llama saved with save_pretrained, then really
damaged on disk."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_kernel_attn.checkpoint_files import checkpoint_problem, safetensors_problem
from hf_kernel_attn.cli import main
from hf_kernel_attn.model_paths import CorruptCheckpointError, load_errors, locate_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _config(hidden: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A whole tiny Llama checkpoint (hidden size 32)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "good"
    LlamaForCausalLM(_config(32)).save_pretrained(path)
    return path


def _copy(good: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def truncated(good: Path, tmp_path: Path) -> Path:
    """model.safetensors cut to its first half."""
    path = _copy(good, tmp_path, "truncated")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return path


def garbage(good: Path, tmp_path: Path) -> Path:
    """model.safetensors overwritten with random bytes."""
    path = _copy(good, tmp_path, "garbage")
    (path / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    return path


def mis_shaped(good: Path, tmp_path: Path) -> Path:
    """The weights of hidden size 32 under a config.json that says 64."""
    path = _copy(good, tmp_path, "mis_shaped")
    cfg = _config(64)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    return path


def truncated_bin(good: Path, tmp_path: Path) -> Path:
    """The weights as a torch.save pytorch_model.bin (no safetensors), cut to its first half."""
    path = _copy(good, tmp_path, "truncated_bin")
    weights = path / "model.safetensors"
    state = AutoModelForCausalLM.from_pretrained(good).state_dict()
    weights.unlink()
    torch.save(state, path / "pytorch_model.bin")
    data = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    return path


DAMAGE = {  # how each checkpoint is damaged -> words of its error line
    truncated: ["model.safetensors", "is truncated"],
    garbage: ["model.safetensors", "is not a safetensors file"],
    mis_shaped: ["model.safetensors", "config.json", "tensor shapes", "[128, 32] in the file, [128, 64]"],
    truncated_bin: ["pytorch_model.bin", "is truncated"],
}


def one_error_line(err: str, path: Path, words: list[str]) -> str:
    """stderr is exactly one non-empty line: ``error: ...`` naming the damaged folder's file and ``words``."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error:") and str(path) in line, line
    for word in words:
        assert word in line, (word, line)
    return line


# ----------------------------------------------------------------------------------------------- the commands


@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__)
def test_eval(good, tmp_path, damage, capsys):
    path = damage(good, tmp_path)
    capsys.readouterr()  # what building the damaged checkpoint printed
    assert main(["eval", "--model", str(path), "--tasks", "wikitext2", "--limit", "1"]) == 2
    one_error_line(capsys.readouterr().err, path, DAMAGE[damage])


@pytest.mark.parametrize("damage", [truncated, mis_shaped], ids=lambda f: f.__name__)
def test_bench_model_mode(good, tmp_path, damage, capsys):
    path = damage(good, tmp_path)
    capsys.readouterr()
    assert main(["bench", "--model", str(path), "--kernels", "elu", "--lengths", "8", "--batch-sizes", "1",
                 "--repeats", "1"]) == 2
    one_error_line(capsys.readouterr().err, path, DAMAGE[damage])


@pytest.mark.parametrize("damage", [truncated, garbage, mis_shaped], ids=lambda f: f.__name__)
def test_decode_bench(good, tmp_path, damage, capsys):
    path = damage(good, tmp_path)
    capsys.readouterr()
    assert main(["decode-bench", "--model", str(path), "--kernels", "elu", "--contexts", "8", "--steps", "1"]) == 2
    one_error_line(capsys.readouterr().err, path, DAMAGE[damage])


def _board(tmp_path: Path, model: Path, jobs: int = 1) -> Path:
    """A leaderboard of one model entry, two rows (softmax, elu), no local data (the model fails first)."""
    cfg = {"output_dir": str(tmp_path / "lb"), "data_dir": None, "context": 32, "limit": 1, "jobs": jobs,
           "models": [{"name": "damaged", "model": str(model), "kernels": ["softmax", "elu"],
                       "tasks": ["wikitext2"]}]}
    path = tmp_path / "board.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_leaderboard_checks_the_files_before_the_sweep(good, tmp_path, capsys):
    """A truncated checkpoint stops the sweep before it starts: nothing is written, no cell is an error."""
    path = truncated(good, tmp_path)
    capsys.readouterr()
    assert main(["leaderboard", str(_board(tmp_path, path))]) == 2
    line = one_error_line(capsys.readouterr().err, path, DAMAGE[truncated])
    assert "leaderboard model 'damaged'" in line
    assert not (tmp_path / "lb").exists()


def test_leaderboard_stops_at_a_checkpoint_that_fails_to_load(good, tmp_path, capsys):
    """Shapes other than config.json's show only as the model loads: the sweep stops there with one line, and
    records no error cell (a re-run with the checkpoint fixed evaluates it)."""
    path = mis_shaped(good, tmp_path)
    capsys.readouterr()
    assert main(["leaderboard", str(_board(tmp_path, path))]) == 2
    one_error_line(capsys.readouterr().err, path, DAMAGE[mis_shaped])
    assert (tmp_path / "lb" / "errors.jsonl").read_text() == ""
    assert not (tmp_path / "lb" / "leaderboard.md").exists()


@pytest.mark.slow(30)
def test_leaderboard_worker_processes_report_one_line(good, tmp_path):
    """--jobs 2 in a real process: the worker's failure comes back as the one line (no worker traceback, no
    transformers load report or progress bar on stderr)."""
    path = mis_shaped(good, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "hf_kernel_attn.cli", "leaderboard", "--jobs", "2",
                           str(_board(tmp_path, path))], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr, path, DAMAGE[mis_shaped])
    assert "leaderboard model 'damaged'" in line
    assert "worker processes" in proc.stdout
    assert (tmp_path / "lb" / "errors.jsonl").read_text() == ""


# ---------------------------------------------------------------------------- the checks behind the commands


def test_a_whole_checkpoint_passes(good):
    assert checkpoint_problem(good) is None
    assert locate_model(str(good)) == str(good)


def test_safetensors_problems(good, tmp_path):
    data = (good / "model.safetensors").read_bytes()
    cases = {b"": "is empty", data[:5]: "is truncated or not a safetensors file", data[:100]: "is truncated",
             data[: len(data) - 1]: f"is truncated: {len(data) - 1} of its {len(data)} bytes",
             data + b"\0": "is not a whole safetensors file", b"\x10" + b"\0" * 7 + b"[not a header]  ":
             "is not a safetensors file", b"\x04" + b"\0" * 7 + b"{no}": "its header is not a safetensors header"}
    for content, words in cases.items():
        path = tmp_path / "x.safetensors"
        path.write_bytes(content)
        assert words in safetensors_problem(path), content[:20]
    path.write_bytes(data)
    assert safetensors_problem(path) is None


def test_a_damaged_shard_is_named(good, tmp_path):
    path = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(good).save_pretrained(path, max_shard_size="50KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (path / "model.safetensors.index.json").is_file()
    assert checkpoint_problem(path) is None
    shards[1].write_bytes(shards[1].read_bytes()[:-10])
    assert checkpoint_problem(path).startswith(f"{shards[1]} is truncated")


def test_tokenizer_json_that_does_not_parse(good, tmp_path):
    path = _copy(good, tmp_path, "tok")
    (path / "tokenizer_config.json").write_text('{"model_max_length": 8,')
    with pytest.raises(CorruptCheckpointError, match="tokenizer_config.json is not valid JSON"):
        locate_model(str(path))


@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__)
def test_load_errors_at_load_time(good, tmp_path, damage):
    """Past the check before loading (e.g. a library caller's own from_pretrained), load_errors turns what
    transformers, safetensors and torch raise into the same one-line error, naming the file."""
    path = damage(good, tmp_path)
    with pytest.raises(CorruptCheckpointError) as info, load_errors(str(path)):
        AutoModelForCausalLM.from_pretrained(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text and all(word in text for word in DAMAGE[damage]), text


def test_load_errors_leaves_other_exceptions_alone(good):
    """Only a damaged checkpoint becomes a ModelLoadError: a bug inside the block stays itself."""
    for exc in (RuntimeError("boom"), ValueError("bad option"), KeyError("k"), json.JSONDecodeError("x", "", 0)):
        with pytest.raises(type(exc)) as info, load_errors(str(good)):
            raise exc
        assert info.value is exc  # a JSON error too, when no file of the checkpoint is damaged


def test_load_errors_holds_transformers_logs_back_only_for_a_failure(good):
    """What transformers logs during a load is written after it (not dropped) unless the load became the line."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    root = logging.getLogger("transformers")
    handler = Keep()
    root.addHandler(handler)
    try:
        with load_errors(str(good)):
            logging.getLogger("transformers.modeling_utils").warning("kept")
            assert seen == []
        assert seen == ["kept"]
        with pytest.raises(CorruptCheckpointError), load_errors(str(good)):
            logging.getLogger("transformers.modeling_utils").warning("dropped")
            raise RuntimeError("size mismatch for x: copying a param with shape torch.Size([2]) from checkpoint, "
                               "the shape in current model is torch.Size([3]).")
        assert seen == ["kept"]
    finally:
        root.removeHandler(handler)
