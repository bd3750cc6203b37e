"""Round trips that never lie: an explicit stock ``attn_implementation`` at load wins, ``set_attn_implementation``
then ``save_pretrained`` saves what runs, ``unpatch`` removes the remote-code entries, and a converted
sentence-transformers model has every module folder its ``modules.json`` names."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.integration.remote_code import MODULE
from tests.conftest import tiny_llama_model

IDS = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved_kernel_model(tmp_path_factory):
    """(a hedgehog checkpoint of a tiny Llama, the stock model's logits, the kernel model's logits)."""
    stock = tiny_llama_model()
    with torch.no_grad():
        stock_logits = stock(IDS).logits
    model = tiny_llama_model()
    hf_kernel_attn.patch(model, kernel="hedgehog")
    with torch.no_grad():
        kernel_logits = model(IDS).logits
    path = tmp_path_factory.mktemp("hedgehog")
    model.save_pretrained(path)
    return path, stock_logits, kernel_logits


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _saved_config(path):
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_explicit_stock_attention_at_load_wins(saved_kernel_model, impl, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    path, stock_logits, kernel_logits = saved_kernel_model
    assert not torch.allclose(stock_logits, kernel_logits, atol=1e-3)  # the two are told apart
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl)
    ours = [w for w in caught if "hf_kernel_attn" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert impl in message and "hedgehog" in message and "unused" in message
    # said once: transformers' own load report does not list the kernel tensors as well
    assert not any("kernel_attn" in r.getMessage() for r in caplog.records)
    assert model.config._attn_implementation == impl
    torch.testing.assert_close(_logits(model), stock_logits, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    saved = _saved_config(tmp_path)
    assert "kernel_attention" not in saved and "auto_map" not in saved
    assert not (tmp_path / f"{MODULE}.py").exists()
    assert not any("kernel_attn" in k for k in _tensor_names(tmp_path))


def _tensor_names(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_load_without_request_still_runs_the_kernel(saved_kernel_model):
    from transformers import AutoModelForCausalLM

    path, _, kernel_logits = saved_kernel_model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the normal path
        model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config._attn_implementation == "hedgehog"
    torch.testing.assert_close(_logits(model), kernel_logits, atol=1e-5, rtol=1e-5)


def test_set_attn_implementation_then_save_saves_what_runs(saved_kernel_model, tmp_path):
    from transformers import AutoModelForCausalLM

    path, stock_logits, _ = saved_kernel_model
    model = AutoModelForCausalLM.from_pretrained(path)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(_logits(model), stock_logits, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    saved = _saved_config(tmp_path)
    assert "kernel_attention" not in saved and "auto_map" not in saved
    assert not any("kernel_attn" in k for k in _tensor_names(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config._attn_implementation == "sdpa"
    torch.testing.assert_close(_logits(again), stock_logits, atol=1e-5, rtol=1e-5)


def test_unpatch_then_save_loads_with_trust_remote_code(saved_kernel_model, tmp_path):
    from transformers import AutoModelForCausalLM

    path, stock_logits, kernel_logits = saved_kernel_model
    assert MODULE in json.dumps(_saved_config(path)["auto_map"])
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    torch.testing.assert_close(_logits(model), kernel_logits, atol=1e-5, rtol=1e-5)
    hf_kernel_attn.unpatch(model)
    assert getattr(model.config, "auto_map", None) is None
    model.save_pretrained(tmp_path)
    assert "auto_map" not in _saved_config(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    torch.testing.assert_close(_logits(reloaded), stock_logits, atol=1e-5, rtol=1e-5)


def test_user_auto_map_entries_survive_unpatch():
    """Only this plugin's entries go: a model's own remote code stays mapped."""
    model = tiny_llama_model()
    hf_kernel_attn.patch(model, kernel="elu")
    model.config.auto_map = {"AutoConfig": "their_code.TheirConfig", "AutoModel": f"{MODULE}.KernelAttnLlamaModel"}
    hf_kernel_attn.unpatch(model)
    assert model.config.auto_map == {"AutoConfig": "their_code.TheirConfig"}


def test_sentence_transformers_module_folders_are_written(minilm_dir, tmp_path):
    """Every folder the converted model's modules.json names exists (all-MiniLM-L6-v2 names 2_Normalize, which
    has no files and is absent from the source folder); sentence-transformers loads it when installed."""
    from hf_kernel_attn.training.tasks.sentence_embedding import copy_sentence_transformers_files

    names = [e["path"] for e in json.loads((minilm_dir / "modules.json").read_text()) if e["path"]]
    assert "2_Normalize" in names
    copy_sentence_transformers_files(minilm_dir, tmp_path)
    for name in names:
        assert (tmp_path / name).is_dir(), name
    assert (tmp_path / "1_Pooling" / "config.json").is_file()


def test_sentence_transformers_loads_a_saved_kernel_minilm(minilm_dir, tmp_path):
    """sentence-transformers (a tool this project did not write) loads a saved kernel MiniLM folder with its
    modules and encodes with the kernel: normalised mean-pooled token states of the same model."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from hf_kernel_attn.training.tasks.sentence_embedding import copy_sentence_transformers_files

    model = AutoModel.from_pretrained(minilm_dir, attn_implementation="elu").eval()
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    copy_sentence_transformers_files(minilm_dir, tmp_path)
    sentences = ["A man is playing a guitar.", "The weather is cold today in the north."]
    got = torch.as_tensor(SentenceTransformer(str(tmp_path), device="cpu").encode(sentences))
    batch = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(got, torch.nn.functional.normalize(pooled, dim=-1), atol=1e-5, rtol=1e-4)
