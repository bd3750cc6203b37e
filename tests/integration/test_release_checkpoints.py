"""Checkpoints saved by an earlier release load into this one and compute what they computed there: logits (or an
encoder's hidden states) and greedy continuations recorded by that release (tests/integration/release_checkpoints/,
written by ``write.py`` in that folder from a checkout of the release)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM

import hf_kernel_attn  # noqa: F401  (the plugin: saved kernel checkpoints load through it)

HERE = Path(__file__).parent / "release_checkpoints"
CHECKPOINTS = sorted(p for p in HERE.glob("*/*") if (p / "record.json").is_file())
PROMPT = torch.arange(3, 3 + 24).remainder(64).unsqueeze(0)


def test_the_release_checkpoints_are_there():
    assert {p.name for p in CHECKPOINTS} >= {"hedgehog-window-sinks-sparse", "gated-deltanet-window", "gla",
                                            "cosine-encoder"}


@pytest.mark.parametrize("folder", CHECKPOINTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_release_checkpoint_loads_and_computes_what_it_did(folder: Path):
    record = json.loads((folder / "record.json").read_text())
    expected = load_file(folder / "expected.safetensors")
    torch.manual_seed(1234)  # a load that re-initialised kernel parameters would not match
    if "hidden" in expected:
        model = AutoModel.from_pretrained(folder).eval()
        with torch.no_grad():
            hidden = model(PROMPT).last_hidden_state
        torch.testing.assert_close(hidden, expected["hidden"], rtol=1e-5, atol=1e-5)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logits = model(PROMPT).logits
            tokens = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
        torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, expected["tokens"])
    saved = model.config.kernel_attention
    assert saved["kernel"] == record["kernel"]
