"""Every shipped training preset (configs/smollm2, configs/minilm) reads without error: keys, kernel options,
``inference_params`` and ``inference_layers`` validated as ``hf-kernel-attn finetune`` reads them."""

from __future__ import annotations

import pytest

from hf_kernel_attn.training.config import load_config
from tests.paths import REPO

PRESETS = sorted([*(REPO / "configs" / "smollm2").glob("*.yaml"), *(REPO / "configs" / "minilm").glob("*.yaml")])


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_preset_reads(path):
    config = load_config(path)
    assert config["kernel"] and config["output_dir"]


def test_the_retrieval_constmem_preset_saves_retrieval_layers_on_a_budget():
    """The 16 retrieval layers get 40 sinks and every query head softmax; the common options reach all 30."""
    config = load_config(REPO / "configs" / "smollm2" / "hedgehog-sinks-window64-retrieval16-constmem.yaml")
    assert config["inference_params"] == {"sparse_cache": 84, "sparse_block": 8}
    assert sorted(config["inference_layers"]) == [2, 5, 6, 7, 8, 14, 15, 17, 18, 19, 20, 21, 22, 23, 24, 26]
    assert all(o == {"sinks": 40, "softmax_heads": list(range(9))} for o in config["inference_layers"].values())
