"""The training config's dataclasses: checked on construction, the defaults and the help come from their fields,
and docs/training.md's key table is what they give (``HF_KERNEL_ATTN_WRITE_DOCS=1 pytest
tests/training/test_config_fields.py`` rewrites it)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from hf_kernel_attn.training import ConfigError, load_config
from hf_kernel_attn.training.config_fields import (
    BudgetConfig,
    DataConfig,
    KernelConfig,
    ModelConfig,
    OutputConfig,
    StageConfig,
    stage_config_class,
)
from hf_kernel_attn.training.config_help import config_keys, help_text, markdown_table
from hf_kernel_attn.training.config_schema import TrainingConfig, all_keys, defaults
from hf_kernel_attn.training.stages import COMMON_DEFAULTS, STAGE_TYPES, stage_names
from tests.paths import REPO
from tests.training.helpers import SHAKESPEARE, lm_config, write_config

DOC = REPO / "docs" / "training.md"
START, END = "<!-- config-keys:start -->", "<!-- config-keys:end -->"
MINIMAL = {"model": "m", "kernel": "hedgehog", "output_dir": "o", "data": {"train": [str(SHAKESPEARE)]},
           "stages": {"lora": {"steps": 2}}}


def _documented(key: str, rows: list[str]) -> bool:
    """``key`` (e.g. stages.lora.r) is one of the help's rows, or matched by a ``stages.<name>.KEY`` or
    ``stages.{a,b}.KEY`` row."""
    parts = key.split(".")
    if key in rows:
        return True
    if len(parts) != 3 or parts[0] != "stages":
        return False
    _, stage, leaf = parts
    return any(row == f"stages.<name>.{leaf}" or (row.startswith("stages.{") and row.endswith(f"}}.{leaf}")
                                                   and stage in row[len("stages.{"):-len(leaf) - 2].split(","))
               for row in rows)


def test_every_key_has_a_type_default_and_help():
    rows = config_keys()
    names = [row.key for row in rows]
    sections = {"data", "stages", *(f"stages.{name}" for name in stage_names())}
    missing = [key for key in all_keys(defaults()) if key not in sections and not _documented(key, names)]
    assert not missing
    assert all(row.type and row.default and row.help for row in rows), [r for r in rows if not r.help]
    for cls in (ModelConfig, KernelConfig, BudgetConfig, OutputConfig, DataConfig, StageConfig):
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), cls


def test_defaults_come_from_the_fields():
    config = defaults()
    assert config["data"]["seq_len"] == 512 and config["budget_clock"] == "wall" and config["kernel_params"] == {}
    assert list(config["stages"]) == list(stage_names())
    for name in stage_names():
        assert config["stages"][name] == {**COMMON_DEFAULTS, **STAGE_TYPES[name].defaults}
    lora = stage_config_class("lora")
    assert dataclasses.is_dataclass(lora) and issubclass(lora, StageConfig) and lora.stage_name == "lora"
    assert [f.name for f in dataclasses.fields(lora)] == list(config["stages"]["lora"])
    config["kernel_params"]["x"] = 1
    assert defaults()["kernel_params"] == {}  # a fresh copy each time


def test_construction_checks_and_fills_the_defaults():
    config = TrainingConfig(**MINIMAL)
    assert isinstance(config.data, DataConfig) and config.data.seq_len == 512
    assert list(config.stages) == list(stage_names()) and config.stages["lora"].steps == 2
    assert config.stages["lora"].lr == 1e-4 and config.stages["transfer"].loss == "mse"
    assert config.to_dict() == {**defaults(), **MINIMAL, "data": {**defaults()["data"], **MINIMAL["data"]},
                                "stages": {**defaults()["stages"], "lora": {**defaults()["stages"]["lora"],
                                                                            "steps": 2}}}
    assert TrainingConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="data.seq_len must be an integer >= 1, got 0"):
        DataConfig(train=["a.txt"], seq_len=0)
    with pytest.raises(ConfigError, match="data.train must be a list of local files or a hub dataset id"):
        DataConfig()
    with pytest.raises(ConfigError, match="stages.lora.lr must be a number > 0"):
        stage_config_class("lora")(lr=0)
    with pytest.raises(ConfigError, match="stages.lora.r must be an integer >= 1"):
        TrainingConfig(**{**MINIMAL, "stages": {"lora": {"steps": 2, "r": 0}}})
    with pytest.raises(ConfigError, match="config key 'output_dir' is required"):
        TrainingConfig(**{**MINIMAL, "output_dir": None})
    with pytest.raises(ConfigError, match="did you mean 'data.seq_len'"):
        TrainingConfig.from_dict({**MINIMAL, "data": {"train": ["a"], "seqlen": 3}})
    with pytest.raises(ConfigError, match="unknown config key 'stages.lroa'"):
        TrainingConfig(**{**MINIMAL, "stages": {"lroa": {}}})


def test_load_config_is_the_dataclass_dict(tmp_path):
    path = write_config(tmp_path / "c.yaml", lm_config("m", tmp_path / "o"))
    config = load_config(path, ["mixed_precision=no", "inference_layers.1={sinks: 2}", "kernel_params.window=8"])
    assert config["mixed_precision"] == "no" and config["inference_layers"] == {1: {"sinks": 2}}
    assert TrainingConfig.from_dict(config).to_dict() == config


def test_help_config_lists_every_key():
    proc = subprocess.run([sys.executable, "-m", "hf_kernel_attn.cli", "finetune", "--help-config"],
                          capture_output=True, text=True, cwd=REPO, check=True)
    assert proc.stdout.strip() == help_text()
    for row in config_keys():
        assert f"  {row.key}: {row.type} = {row.default}\n" in proc.stdout
    assert "  data.seq_len: int = 512\n" in proc.stdout
    assert "stages.<name>.lr: float = transfer: 0.01, distill: 0.001, lora: 0.0001, full: 2e-05" in proc.stdout


def test_docs_table_is_the_fields():
    table = markdown_table()
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lacks the markers {START} … {END}"
    head, rest = text.split(START, 1)
    current, tail = rest.split(END, 1)
    if os.environ.get("HF_KERNEL_ATTN_WRITE_DOCS") == "1":
        DOC.write_text(f"{head}{START}\n{table}\n{END}{tail}")
        return
    assert current.strip() == table, ("docs/training.md's config-key table differs from the config's dataclasses; "
                                      "rewrite it with HF_KERNEL_ATTN_WRITE_DOCS=1 pytest "
                                      "tests/training/test_config_fields.py")
