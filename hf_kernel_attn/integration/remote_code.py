"""A saved kernel model that loads in tools that never import the plugin (``trust_remote_code=True``).

``save_pretrained`` of a kernel model also writes ``hf_kernel_attn_model.py`` — one thin subclass per
auto class of the architecture, whose module imports ``hf_kernel_attn`` (which attaches the kernels
from ``config.kernel_attention`` when the model is built) — and ``auto_map`` entries pointing at it,
as hub models with custom code do. So ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``
and stock ``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`` run the kernel.
Without ``trust_remote_code`` transformers refuses the folder instead of silently running softmax.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

MODULE = "hf_kernel_attn_model"
# (auto class, mapping in transformers.models.auto.modeling_auto)
_AUTO = (
    ("AutoModel", "MODEL_MAPPING_NAMES"),
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
)

_HEADER = '''"""Written by hf_kernel_attn: this model's attention runs an hf_kernel_attn kernel
(config.kernel_attention). Loading it with trust_remote_code=True imports the plugin, which attaches the
kernels; the classes below are the stock transformers classes under a name transformers can map."""

try:
    import hf_kernel_attn  # noqa: F401  registers the kernels and attaches them when the model is built
except ImportError as exc:
    raise ImportError(
        "this model runs an hf_kernel_attn attention kernel (config.kernel_attention); install the plugin: "
        "pip install hf_kernel_attn"
    ) from exc

import transformers
'''


def classes_for(model_type: str) -> dict[str, str]:
    """{auto class: stock class name} for every auto class that knows ``model_type``."""
    from transformers.models.auto import modeling_auto

    out = {}
    for auto, mapping in _AUTO:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, str):
            out[auto] = name
    return out


def module_source(classes: dict[str, str]) -> str:
    lines = [_HEADER]
    for name in sorted(set(classes.values())):
        lines.append(f"\n\nclass KernelAttn{name}(transformers.{name}):\n    pass\n")
    return "".join(lines)


def write_remote_code(save_directory: str | os.PathLike, config: Any) -> None:
    """Add the module and ``auto_map`` to a saved kernel model (no-op for unknown architectures)."""
    classes = classes_for(getattr(config, "model_type", ""))
    if not classes:
        return
    with open(os.path.join(save_directory, f"{MODULE}.py"), "w") as f:
        f.write(module_source(classes))
    path = os.path.join(save_directory, "config.json")
    with open(path) as f:
        data = json.load(f)
    data["auto_map"] = {auto: f"{MODULE}.KernelAttn{name}" for auto, name in classes.items()}
    fd, tmp = tempfile.mkstemp(dir=save_directory, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def ours(auto_map: Any) -> list[str]:
    """The auto classes of an ``auto_map`` that point at the module this plugin writes."""
    if not isinstance(auto_map, dict):
        return []
    return [auto for auto, ref in auto_map.items() if isinstance(ref, str) and ref.split(".")[0] == MODULE]


def forget_remote_code(config: Any) -> None:
    """Drop this plugin's ``auto_map`` entries from an in-memory config (a model that no longer runs a kernel)."""
    auto_map = getattr(config, "auto_map", None)
    stale = ours(auto_map)
    if not stale:
        return
    kept = {auto: ref for auto, ref in auto_map.items() if auto not in stale}
    if kept:
        config.auto_map = kept
    else:
        delattr(config, "auto_map")


def remove_remote_code(save_directory: str | os.PathLike) -> None:
    """A saved model without a kernel: remove this plugin's ``auto_map`` entries from its config.json and its
    module file, so the folder never points ``trust_remote_code`` at a kernel it does not run."""
    path = os.path.join(save_directory, "config.json")
    module = os.path.join(save_directory, f"{MODULE}.py")
    if os.path.exists(module):
        os.remove(module)
    if not os.path.exists(path):
        return
    with open(path) as f:
        data = json.load(f)
    stale = ours(data.get("auto_map"))
    if not stale:
        return
    kept = {auto: ref for auto, ref in data["auto_map"].items() if auto not in stale}
    if kept:
        data["auto_map"] = kept
    else:
        del data["auto_map"]
    fd, tmp = tempfile.mkstemp(dir=save_directory, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
