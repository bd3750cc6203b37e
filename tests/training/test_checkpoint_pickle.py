"""Checkpoint files never unpickle arbitrary objects: ``rng.pt`` holds tensors and plain values, every
file loads with ``weights_only=True``, and a tampered file whose pickle would run code is refused without running it."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_kernel_attn.training import checkpoint as ckpt
from tests.paths import REPO

ROOT = REPO


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())  # what the generators give next
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    ckpt.set_rng_state(ckpt.load_file(tmp_path, "rng.pt"))
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_a_tampered_checkpoint_file_is_refused_and_runs_nothing(tmp_path):
    """A real malicious pickle (its __reduce__ calls a function that writes a file), written by another process:
    loading it raises a ValueError naming the file, and the file is never written."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "checkpoint-1"
    evil.mkdir()
    script = (
        "import pathlib, torch\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        f"        return (pathlib.Path.write_text, (pathlib.Path({str(marker)!r}), 'ran'))\n"
        f"torch.save({{'torch': torch.get_rng_state(), 'x': Evil()}}, {str(evil / 'rng.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    with pytest.raises(ValueError, match=r"rng\.pt.*cannot be read"):
        ckpt.load_file(evil, "rng.pt")
    assert not marker.exists()
    # the same file with pickle as torch.load(weights_only=False) would read it does run the payload: the test's
    # file really is malicious
    torch.load(evil / "rng.pt", weights_only=False)
    assert marker.read_text() == "ran"


def test_no_checkpoint_load_unpickles_freely():
    hits = subprocess.run(["grep", "-rn", "weights_only=False", str(ROOT / "hf_kernel_attn")], capture_output=True,
                          text=True).stdout
    assert hits == "", hits
