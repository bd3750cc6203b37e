"""What the installed transformers calls things, asked of transformers itself (never of its version number)."""

from __future__ import annotations

import inspect

import pytest
from transformers import DynamicCache, LlamaConfig, LlamaModel

# the keyword that passes a cache to generate() and to a model's forward: ``cache`` in newer transformers,
# ``past_key_values`` in older ones (transformers 5.0 to 5.23)
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_arg(cache) -> dict:
    """``model.generate(ids, **cache_arg(cache))``: the cache under the name this transformers takes."""
    return {CACHE_ARG: cache}


def enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing on, under this transformers' name for it (``activation_checkpointing_enable``
    in newer releases, ``gradient_checkpointing_enable`` before)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


# whether attention modules hand their kwargs to ``cache.update(..., kwargs=...)`` (newer transformers), which the
# plugin's bounded decode cache (RecurrentStateCache) needs; before, generation keeps transformers' DynamicCache
STATE_CACHE = "cache_kwargs" not in inspect.signature(DynamicCache.update).parameters
needs_state_cache = pytest.mark.skipif(not STATE_CACHE, reason="this transformers' attention modules do not pass "
                                       "their kwargs to cache.update: the bounded decode cache is not used")


# whether a config read from a dict keeps its ``attn_implementation`` (newer transformers; before, from_pretrained
# resets it): where it does not, the saved-model marker cannot make a load without the plugin fail
CONFIG_KEEPS_ATTN = LlamaConfig.from_dict({"attn_implementation": "eager"})._attn_implementation == "eager"
