"""``hf-kernel-attn leaderboard CONFIG --set KEY=VALUE``: overrides reach the checked config, bad ones name the key."""

from __future__ import annotations

import pytest
import yaml

from hf_kernel_attn.leaderboard.config import load_leaderboard_config
from tests.paths import REPO

QUICK = REPO / "configs" / "leaderboard" / "quick.yaml"


def test_overrides_change_exactly_the_named_keys():
    raw = yaml.safe_load(QUICK.read_text())
    cfg = load_leaderboard_config(QUICK, overrides=[
        "limit=1", "speed.repeats=1", "models.2.finetune_set=[stages.full.steps=2, max_steps=3]", "jobs=1"])
    assert cfg["limit"] == 1 and raw["limit"] != 1
    assert cfg["speed"] == {"length": raw["speed"]["length"], "repeats": 1}
    assert cfg["models"][2]["finetune_set"] == ["stages.full.steps=2", "max_steps=3"]
    assert "finetune_set" not in raw["models"][2]
    assert cfg["jobs"] == 1
    assert [m["name"] for m in cfg["models"]] == [m["name"] for m in raw["models"]]
    assert cfg["models"][0]["tasks"] == raw["models"][0]["tasks"]


@pytest.mark.parametrize(("item", "message"), [
    ("models.7.kernels=[elu]", "is a list of 3; index it with 0..2"),
    ("limit", "--set expects KEY=VALUE"),
    ("speed.repeats=0", "speed.repeats must be an integer >= 1"),
    ("no_such_key=1", "no_such_key"),
    ("limit=[", "cannot parse"),
])
def test_bad_overrides_name_the_problem(item, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_leaderboard_config(QUICK, overrides=[item])
