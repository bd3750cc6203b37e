"""A leaderboard config's ``quick:`` list (``--quick``): KEY=VALUE overrides applied before ``--set``."""

from __future__ import annotations

import pytest
import yaml

from hf_kernel_attn.cli import main
from hf_kernel_attn.leaderboard.config import load_leaderboard_config


def _write(tmp_path, **top):
    path = tmp_path / "lb.yaml"
    models = [{"name": "m", "model": "some/model", "kernels": ["softmax"], "tasks": ["passkey"]}]
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "lb"), "data_dir": None, "lengths": [512, 1024],
                                    "depths": [10, 90], "samples": 2, "models": models, **top}))
    return path


def test_quick_applies_its_overrides_before_set(tmp_path):
    path = _write(tmp_path, quick=["lengths=[256]", "samples=1", f"output_dir={tmp_path / 'quick'}"])
    full = load_leaderboard_config(path)
    assert (full["lengths"], full["samples"], full["output_dir"]) == ([512, 1024], 2, str(tmp_path / "lb"))
    quick = load_leaderboard_config(path, quick=True, overrides=["samples=3"])
    assert (quick["lengths"], quick["samples"], quick["output_dir"]) == ([256], 3, str(tmp_path / "quick"))
    assert "quick" not in quick and "quick" not in full


@pytest.mark.parametrize("quick, match", [
    (None, "has no quick: list"),
    ("lengths=[256]", "quick must be a list of KEY=VALUE overrides"),
    (["lenghts=[256]"], "did you mean 'lengths'"),
])
def test_bad_quick_names_the_problem(tmp_path, quick, match):
    path = _write(tmp_path, **({} if quick is None else {"quick": quick}))
    with pytest.raises(ValueError, match=match):
        load_leaderboard_config(path, quick=True)


def test_the_command_takes_quick(tmp_path, capsys):
    assert main(["leaderboard", str(_write(tmp_path)), "--quick"]) == 2
    assert "has no quick: list" in capsys.readouterr().err
