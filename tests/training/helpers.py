"""Tiny training configs and log readers shared by the training tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.paths import DATA

SHAKESPEARE = DATA / "tinyshakespeare" / "train.txt"
STSB = DATA / "stsb" / "train.tsv"


def lm_config(model, out, **extra):
    cfg = {
        "model": str(model), "task": "causal_lm", "kernel": "hedgehog",
        "data": {"train": [str(SHAKESPEARE)], "max_train_chars": 30000, "seq_len": 32, "batch_size": 4,
                 "validation_batches": 2},
        "stages": {"transfer": {"steps": 4}, "lora": {"steps": 4, "lr": 1e-3}},
        "save_every": 3, "output_dir": str(out), "log_with": "none", "validate": False,
    }
    for key, value in extra.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_log(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "training_log.jsonl").read_text().splitlines()]
