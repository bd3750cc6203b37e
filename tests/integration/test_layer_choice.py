"""Automatic layer choice (``layers="auto:K"``): the per-layer errors against an independent measurement, the
choice, where it is recorded, and the training config's version (chosen after attention transfer)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn.integration.layer_choice import choose_softmax_layers, parse_auto


def tiny(layers=4, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # layers with different sharpness, so their errors differ
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.weight.mul_(1 + 6 * ((i * 7) % layers))
    return model


def attention_outputs(model, ids):
    """The input of each layer's o_proj (the attention output) in one forward."""
    seen = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_errors_and_choice_match_an_independent_measurement():
    """Layer i's error = MSE between layer i's attention output with only layer i converted and the softmax
    model's (earlier layers are softmax, so its inputs are the original ones): the transfer loss, measured
    without the recorder."""
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    model = tiny()
    softmax = attention_outputs(model, ids)
    expected = {}
    for i in range(4):
        hf_kernel_attn.patch(model, kernel="elu", layers=[i])
        expected[i] = (attention_outputs(model, ids)[i] - softmax[i]).pow(2).mean().item()
    hf_kernel_attn.unpatch(model)
    hf_kernel_attn.patch(model, kernel="elu", layers="auto:2", calibration=ids)
    record = model.config.kernel_attention["auto"]
    got = {int(i): e for i, e in record["errors"].items()}
    assert got.keys() == expected.keys()
    for i in expected:
        assert got[i] == pytest.approx(expected[i], rel=1e-5)
    worst = sorted(sorted(expected, key=lambda i: -expected[i])[:2])
    assert record["softmax_layers"] == worst and record["keep_softmax"] == 2
    assert record["calibration_tokens"] == 80
    kinds = [layer.self_attn.kernel_attn.name for layer in model.model.layers]
    assert [i for i, k in enumerate(kinds) if k == "softmax"] == worst
    assert all(k == "elu" for i, k in enumerate(kinds) if i not in worst)


def test_choice_survives_save_and_load(tmp_path):
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    model = tiny()
    hf_kernel_attn.patch(model, kernel="hedgehog", layers="auto:1", calibration={"input_ids": ids}, window=8)
    model.save_pretrained(tmp_path / "m")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert loaded.config.kernel_attention == model.config.kernel_attention
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_from_pretrained_auto(tmp_path):
    tiny().save_pretrained(tmp_path / "base")
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    model = hf_kernel_attn.from_pretrained(tmp_path / "base", kernel="elu", layers="auto:3", calibration=ids)
    assert len(model.config.kernel_attention["auto"]["softmax_layers"]) == 3
    with pytest.raises(ValueError, match="needs calibration"):
        hf_kernel_attn.from_pretrained(tmp_path / "base", kernel="elu", layers="auto:1")


def test_choose_breaks_ties_by_index():
    assert choose_softmax_layers({0: 1.0, 1: 3.0, 2: 3.0, 3: 0.5}, 2) == [1, 2]
    assert choose_softmax_layers({0: 1.0, 1: 3.0}, 0) == []


@pytest.mark.parametrize("layers, message", [
    ("auto", "or 'auto:K'"), ("auto:x", "or 'auto:K'"), ("auto:-1", "or 'auto:K'"),
    ("first:2", "or 'auto:K'"), ("auto:9", "cannot keep 9 layers"),
])
def test_bad_auto_strings(layers, message):
    with pytest.raises(ValueError, match=message):
        hf_kernel_attn.patch(tiny(), kernel="elu", layers=layers, calibration=torch.ones(1, 4, dtype=torch.long))


def test_bad_calibration():
    with pytest.raises(ValueError, match="needs calibration text"):
        hf_kernel_attn.patch(tiny(), kernel="elu", layers="auto:1")
    with pytest.raises(ValueError, match="integer tensor"):
        hf_kernel_attn.patch(tiny(), kernel="elu", layers="auto:1", calibration=torch.randn(1, 4))
    with pytest.raises(ValueError, match="only used with layers='auto:K'"):
        hf_kernel_attn.patch(tiny(), kernel="elu", calibration=torch.ones(1, 4, dtype=torch.long))
    assert parse_auto([0, 1]) is None


def test_training_chooses_after_transfer(tiny_llama, tmp_path):
    """layers: auto:1 in a training config: every layer is trained by attention transfer, then the layer
    with the largest held-out transfer error goes back to softmax before LoRA; the choice is in
    auto_layers.json and the saved config."""
    from hf_kernel_attn.training import Trainer, load_config
    from tests.training.helpers import SHAKESPEARE

    cfg = {"model": str(tiny_llama), "task": "causal_lm", "kernel": "hedgehog", "layers": "auto:1",
           "kernel_params": {"window": 4},
           "data": {"train": [str(SHAKESPEARE)], "max_train_chars": 20000, "seq_len": 32, "batch_size": 2,
                    "validation_batches": 2},
           "stages": {"transfer": {"steps": 3}, "lora": {"steps": 2, "lr": 1e-3}},
           "save_every": 0, "output_dir": str(tmp_path / "o"), "log_with": "none", "validate": False}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    trainer = Trainer(load_config(tmp_path / "c.yaml"))
    final = trainer.run()
    record = json.loads((tmp_path / "o" / "auto_layers.json").read_text())
    assert len(record["softmax_layers"]) == 1 and set(record["errors"]) == {"0", "1"}
    errors = {int(i): e for i, e in record["errors"].items()}
    assert record["softmax_layers"] == [max(errors, key=errors.get)]
    saved = json.loads((final / "config.json").read_text())["kernel_attention"]
    assert saved["auto"] == record
    assert saved["layers"] == {str(record["softmax_layers"][0]): "softmax"}
    with pytest.raises(Exception, match="auto:K"):
        load_config(tmp_path / "c.yaml", ["layers=auto:two"])
