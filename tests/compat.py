"""What the installed transformers calls things, asked of transformers itself (never of its version number)."""

from __future__ import annotations

import inspect

from transformers import LlamaModel

# the keyword that passes a cache to generate() and to a model's forward: ``cache`` in newer transformers,
# ``past_key_values`` in older ones (transformers 5.0 to 5.23)
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_arg(cache) -> dict:
    """``model.generate(ids, **cache_arg(cache))``: the cache under the name this transformers takes."""
    return {CACHE_ARG: cache}
