"""``with_saved_kernel_options``: options added to a saved kernel config, for every layer running the kernel and
per layer (``inference_params`` / ``inference_layers`` of a training config)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from hf_kernel_attn.config import CONFIG_KEY, KernelAttentionConfig
from hf_kernel_attn.integration.loading import with_saved_kernel_options


def saved_config() -> LlamaConfig:
    config = LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    hybrid = {"kernel": "hedgehog", "params": {"window": 8, "sinks": 2}}
    kernel = KernelAttentionConfig.create("hedgehog", layers={0: hybrid, 1: "softmax", 2: hybrid}, window=8, sinks=2)
    setattr(config, CONFIG_KEY, kernel.to_dict())
    return config


def test_layer_options_go_to_their_layer_on_top_of_the_common_ones():
    out = KernelAttentionConfig.from_dict(getattr(with_saved_kernel_options(
        saved_config(), {"sparse_cache": 4}, {2: {"sinks": 6, "softmax_heads": [0, 1, 2, 3]}}), CONFIG_KEY))
    assert out.params["sparse_cache"] == 4 and "softmax_heads" not in out.params
    assert out.layers[2].params == {"window": 8, "sinks": 6, "sparse_cache": 4, "softmax_heads": [0, 1, 2, 3]}
    assert out.layers[0].params["sinks"] == 2 and out.layers[0].params["sparse_cache"] == 4
    assert out.layers[1].kernel == "softmax"


@pytest.mark.parametrize(("layers", "message"), [
    ({3: {"sinks": 6}}, r"layer options for layer 3: the model has layers 0\.\.2"),
    ({1: {"sinks": 6}}, "layer options for layer 1: it runs 'softmax', not the model's kernel 'hedgehog'"),
    ({0: {"sink": 6}}, "sink"),
])
def test_layer_options_errors_name_the_problem(layers, message):
    with pytest.raises(ValueError, match=message):
        config = with_saved_kernel_options(saved_config(), {}, layers)
        KernelAttentionConfig.from_dict(getattr(config, CONFIG_KEY)).validate()
