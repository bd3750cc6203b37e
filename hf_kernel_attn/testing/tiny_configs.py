"""Tiny random configs of any transformers architecture, for the coverage harness (:mod:`.architectures`).

:data:`TINY` holds canonical tiny sizes (hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 128, 128 positions); each
is applied under whichever name a config class knows it by, and only where the class has that field.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

VOCAB = 128

# canonical tiny sizes; each key is applied under whichever name the config class knows (attribute_map aliases
# included), and skipped when the config has no such field
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "n_inner": 64,
    "d_ff": 64,
    "ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 0,
    "sep_token_id": 2,
    "cls_token_id": 1,
    # mixture-of-experts configs
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    # vision configs
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
}

# local-attention windows, shrunk below the input length (so windowed layers differ from full attention) where the
# config has one by default; a config whose default is None (full attention) keeps None
WINDOWS: dict[str, int] = {
    "sliding_window": 4,
    "local_attention": 8,  # ModernBERT's total window (its config.sliding_window is half of it)
    "window_size": 4,  # GPT-Neo's local layers
}


def _config_fields(cls: type) -> dict[str, Any]:
    """The config class's fields and their defaults."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls)}
    params = inspect.signature(cls.__init__).parameters
    return {n: p.default for n, p in params.items() if n not in ("self", "kwargs")}


def tiny_overrides(model_type: str) -> dict[str, Any]:
    """The TINY sizes under the names ``model_type``'s config class uses (only the fields it has)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = _config_fields(cls)
    amap = getattr(cls, "attribute_map", {}) or {}
    out: dict[str, Any] = {}
    for key, value in TINY.items():
        name = amap.get(key, key)
        if name in fields:
            out.setdefault(name, value)
    for name, value in WINDOWS.items():
        if isinstance(fields.get(name), int):
            out[name] = value
    return out


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny random config of ``model_type`` built with ``AutoConfig.for_model``."""
    from transformers import AutoConfig

    kwargs = tiny_overrides(model_type)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)
