"""transformers integration on tiny random configs of four families, plus the error interface."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface

import hf_kernel_attn
from hf_kernel_attn.kernels import KERNELS
from tests.compat import enable_checkpointing

CAUSAL = [n for n, c in KERNELS.items() if c.supports_causal]


def tiny(family: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    common = dict(vocab_size=97, num_hidden_layers=3, num_attention_heads=4)
    if family == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_key_value_heads=2, **common)
        cls = LlamaForCausalLM
    elif family == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_key_value_heads=2, **common)
        cls = Qwen2ForCausalLM
    elif family == "gpt2":
        cfg = GPT2Config(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=128)
        cls = GPT2LMHeadModel
    elif family == "bert":
        cfg = BertConfig(hidden_size=64, intermediate_size=96, max_position_embeddings=128, **common)
        cls = BertModel
    else:
        raise AssertionError(family)
    return cls._from_config(cfg, attn_implementation=attn).eval()


def hidden(model, ids, mask=None, **kw):
    out = model(input_ids=ids, attention_mask=mask, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_every_kernel_registered_with_both_interfaces():
    for name in KERNELS:
        assert name in AttentionInterface._global_mapping
        assert name in AttentionMaskInterface._global_mapping
    assert set(hf_kernel_attn.available_kernels()) == set(KERNELS)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
def test_softmax_kernel_equals_sdpa(family):
    model = tiny(family)
    ids = torch.randint(0, 97, (2, 11))
    mask = torch.ones_like(ids)
    if family == "bert":
        mask[1, 7:] = 0
    else:
        mask[1, :4] = 0
    # generate()'s positions (patched decoders derive these themselves; stock SDPA would number the pads)
    kw = {} if family == "bert" else {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
    with torch.no_grad():
        ref = hidden(model, ids, mask, **kw)
        model.set_attn_implementation("softmax")
        out = hidden(model, ids, mask, **kw)
    real = mask.bool()
    assert model.config._attn_implementation == "softmax"
    assert (out - ref)[real].abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_stock_loading_path_runs_every_kernel(family, kernel, tmp_path):
    is_decoder = family != "bert"
    if is_decoder and not KERNELS[kernel].supports_causal:
        with pytest.raises(ValueError, match="bidirectional only"):
            tiny(family, attn=kernel)
        return
    if not is_decoder and not KERNELS[kernel].supports_bidirectional:
        with pytest.raises(ValueError, match="causal only"):
            hidden(tiny(family, attn=kernel), torch.randint(0, 97, (2, 9)))
        return
    model = tiny(family, attn=kernel)  # stock _from_config(attn_implementation=<kernel>)
    assert model.config._attn_implementation == kernel
    assert model.config.kernel_attention["kernel"] == kernel
    ids = torch.randint(0, 97, (2, 9))
    out = hidden(model, ids)
    out.float().pow(2).mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_hybrid_layers_and_round_trip(tmp_path):
    model = tiny("llama")
    hf_kernel_attn.patch(model, kernel="performer", layers=[1], num_features=32, seed=3)
    kinds = [layer.self_attn.kernel_attn.name for layer in model.model.layers]
    assert kinds == ["softmax", "performer", "softmax"]
    assert model.model.layers[1].self_attn.kernel_attn.omega.shape == (32, 16)
    hf_kernel_attn.patch(model, kernel="elu", layers={0: "softmax", -1: {"kernel": "cosine", "params": {"gain": 5.0}}})
    kinds = [layer.self_attn.kernel_attn.name for layer in model.model.layers]
    assert kinds == ["softmax", "elu", "cosine"]
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["kernel_attention"]["layers"] == {"0": "softmax", "2": {"kernel": "cosine", "params": {"gain": 5.0}}}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert [layer.self_attn.kernel_attn.name for layer in reloaded.model.layers] == kinds
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    # the library loader: kernel options and transformers kwargs in one call
    other = hf_kernel_attn.from_pretrained(tmp_path, kernel="gaussian", sigma=2.0, dtype=torch.float32)
    assert other.config._attn_implementation == "gaussian"
    assert other.model.layers[0].self_attn.kernel_attn.options.sigma == 2.0
    cfg = hf_kernel_attn.kernel_config(other)
    assert cfg.kernel == "gaussian" and cfg.params == {"sigma": 2.0}


def test_learnable_parameters_are_trainable_submodules():
    model = tiny("llama")
    hf_kernel_attn.patch(model, kernel="hedgehog", layers={0: "gaussian", 2: "cosine"})
    names = {n for n, _ in model.named_parameters() if ".kernel_attn." in n}
    assert "model.layers.0.self_attn.kernel_attn.log_gain" in names
    assert "model.layers.1.self_attn.kernel_attn.weight_q" in names
    assert "model.layers.2.self_attn.kernel_attn.log_gain" in names
    model.train()
    enable_checkpointing(model)
    ids = torch.randint(0, 97, (2, 12))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[1].self_attn.kernel_attn.weight_q.grad.abs().sum() > 0


def test_unpatch_restores_softmax():
    model = tiny("gpt2")
    ids = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        ref = model(ids).logits
        hf_kernel_attn.patch(model, kernel="taylor")
        assert not torch.allclose(model(ids).logits, ref)
        hf_kernel_attn.unpatch(model)
        assert torch.equal(model(ids).logits, ref)
    assert not hasattr(model.config, "kernel_attention")


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kernel="softmaxx"), "unknown kernel 'softmaxx'; available kernels"),
        (dict(kernel="gaussian", sigma=0), r"sigma must be a finite number in \[0.0001, "),
        (dict(kernel="gaussian", sigma=-1.0), r"sigma must be a finite number in \[0.0001, "),
        (dict(kernel="performer", num_features=0), r"num_features must be an integer in \[1, "),
        (dict(kernel="elu", chunk_size=0), r"chunk_size must be an integer in \[1, "),
        (dict(kernel="elu", feature_dim=8), r"unknown option\(s\) \['feature_dim'\] for kernel 'elu'; valid options"),
        (dict(kernel="hedgehog", layers={7: "softmax"}), "out of range: the model has 3 attention layers"),
        (dict(kernel="hedgehog", layers={0: "nope"}), "unknown kernel 'nope'"),
        (dict(kernel="hedgehog", layers="all"), "layers must be None, a list"),
        (dict(kernel="skyformer"), "bidirectional only"),
    ],
)
def test_bad_input_raises_at_patch_time(kwargs, match):
    model = tiny("llama")
    with pytest.raises(ValueError, match=match):
        hf_kernel_attn.patch(model, **kwargs)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model.config, "kernel_attention")
    assert not any(hasattr(m, "kernel_attn") for m in model.modules())


def test_unsupported_model_class_is_named():
    cfg = BloomConfig(vocab_size=97, hidden_size=32, n_layer=2, n_head=4)
    model = BloomForCausalLM(cfg)
    with pytest.raises(ValueError, match="BloomForCausalLM does not dispatch its attention through"):
        hf_kernel_attn.patch(model, kernel="elu")


def test_sliding_window_layers_kept_native():
    """Qwen2 with use_sliding_window: layers from max_window_layers on slide (window 8) and keep exact softmax over
    that window; the others get the kernel. (Once refused whole.)"""
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    model = hf_kernel_attn.patch(Qwen2ForCausalLM(cfg), kernel="elu")
    kernels = [layer.self_attn.kernel_attn for layer in model.model.layers]
    assert [k.name for k in kernels] == ["elu", "softmax"] and kernels[1].options.window == 8
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_four_d_mask_rejected():
    model = tiny("llama")
    hf_kernel_attn.patch(model, kernel="elu")
    ids = torch.randint(0, 97, (1, 6))
    mask4d = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2-D key-padding mask"):
        model(ids, attention_mask=mask4d)


def test_kernel_config_rejects_bad_dict():
    with pytest.raises(ValueError, match="valid keys"):
        hf_kernel_attn.KernelAttentionConfig.from_dict({"kernel": "elu", "extra": 1})
