"""A saved kernel model that loads in tools that never import the plugin (``trust_remote_code=True``).

``save_pretrained`` of a kernel model also writes ``hf_kernel_attn_model.py`` — one thin subclass per
auto class of the architecture, in a module that imports ``hf_kernel_attn`` (which attaches the kernels
from ``config.kernel_attention`` when the model is built) and the modules of the kernels of your own the model
uses: a single-file top-level module is copied into the folder and imported from there, any other by name —
and ``auto_map`` entries pointing at it, as hub models with custom code do. Its docstring lists exactly what it
imports. So ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` and stock
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`` run the kernel. Without
``trust_remote_code`` nothing of the folder runs (docs/security.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..config import CONFIG_KEY
from ..fileio import write_json_atomic, write_text_atomic
from ..kernels import KERNELS
from ..kernels.registry import REMOTE_PACKAGE

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

_HEADER = '''"""Written by hf_kernel_attn: this model's attention runs hf_kernel_attn kernels (config.kernel_attention).

Loading it with trust_remote_code=True runs this file, which imports exactly:
{imports}
The classes below are the stock transformers classes under names that transformers' auto classes can map."""

try:
    import hf_kernel_attn  # noqa: F401  registers the kernels and attaches them when the model is built
    from hf_kernel_attn.kernels import KERNELS as _REGISTERED
except ImportError as exc:
    raise ImportError(
        "this model runs an hf_kernel_attn attention kernel (config.kernel_attention); install the plugin: "
        "pip install hf_kernel_attn"
    ) from exc

import transformers
{kernel_imports}'''

_PLUGIN_LINE = ("* hf_kernel_attn (the plugin, which must be installed): it registers its built-in kernels with\n"
                "  transformers and wraps a few transformers methods for the whole process, listed in its\n"
                "  docs/security.md; it imports no module that a checkpoint names;\n"
                "* transformers;\n")


def classes_for(model_type: str) -> dict[str, str]:
    """{auto class: stock class name} for every auto class that knows ``model_type``."""
    from transformers.models.auto import modeling_auto

    out = {}
    for auto, mapping in _AUTO:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, str):
            out[auto] = name
    return out


def shippable_file(module: str) -> Path | None:
    """The source file of a loaded kernel module that a checkpoint can carry: a single-file top-level module
    (``my_kernels.py``), or one that transformers itself loaded from a checkpoint (``transformers_modules.*``)
    whose file is its own. None for packages, submodules of a package (their relative imports would break)
    and ``__main__``."""
    loaded = sys.modules.get(module)
    origin = getattr(loaded, "__file__", None)
    if loaded is None or origin is None or hasattr(loaded, "__path__") or not origin.endswith(".py"):
        return None
    if "." in module and not module.startswith(REMOTE_PACKAGE):
        return None
    if module == "__main__":
        return None
    return Path(origin)


def kernel_modules(config: Any) -> dict[str, str]:
    """{kernel name: loaded module} for the user kernels a kernel model's config uses."""
    data = getattr(config, CONFIG_KEY, None) or {}
    names = set(data.get("modules") or {})
    return {name: KERNELS[name].__module__ for name in sorted(names) if name in KERNELS}


def module_source(classes: dict[str, str], shipped: dict[str, str], installed: dict[str, str]) -> str:
    """The remote-code module. ``shipped``: {kernel: file stem} of kernel modules copied into the folder;
    ``installed``: {kernel: module} of kernel modules the user's environment must have."""
    docs = [_PLUGIN_LINE]
    lines = []
    for stem in sorted(set(shipped.values())):
        kernels = sorted(k for k, s in shipped.items() if s == stem)
        docs.append(f"* {stem}.py from this folder (kernel {', '.join(map(repr, kernels))}), unless every kernel "
                    "it defines is already registered;\n")
        lines.append(f"\nif not {{{', '.join(map(repr, kernels))}}} <= set(_REGISTERED):\n"
                     f"    from .{stem} import __name__ as _{stem}_module  # noqa: F401  registers the kernel(s)\n")
    for module in sorted(set(installed.values())):
        kernels = sorted(k for k, m in installed.items() if m == module)
        if module == "__main__":
            docs.append(f"* nothing for kernel {', '.join(map(repr, kernels))}: it was defined in a script; "
                        "register it in your process before loading;\n")
            continue
        docs.append(f"* {module}, installed in your environment (kernel {', '.join(map(repr, kernels))});\n")
        lines.append(f"\nimport {module}  # noqa: F401,E402  registers kernel(s) {kernels}\n")
    out = [_HEADER.format(imports="".join(docs).rstrip("\n").rstrip(";") + ".", kernel_imports="".join(lines))]
    for name in sorted(set(classes.values())):
        out.append(f"\n\nclass KernelAttn{name}(transformers.{name}):\n    pass\n")
    return "".join(out)


def write_remote_code(save_directory: str | os.PathLike, config: Any) -> None:
    """Add the module, the kernel modules it can carry, and ``auto_map`` to a saved kernel model (no-op for
    unknown architectures). Files get the modes transformers' own files have."""
    classes = classes_for(getattr(config, "model_type", ""))
    if not classes:
        return
    save_directory = Path(save_directory)
    shipped, installed = {}, {}
    for kernel, module in kernel_modules(config).items():
        source = shippable_file(module)
        if source is None:
            installed[kernel] = module
            continue
        stem = module.rsplit(".", 1)[-1]
        target = save_directory / f"{stem}.py"
        if not (target.exists() and os.path.samefile(source, target)):
            write_text_atomic(target, source.read_text(encoding="utf-8"))
        shipped[kernel] = stem
    write_text_atomic(save_directory / f"{MODULE}.py", module_source(classes, shipped, installed))
    path = save_directory / "config.json"
    with open(path) as f:
        data = json.load(f)
    data["auto_map"] = {auto: f"{MODULE}.KernelAttn{name}" for auto, name in classes.items()}
    write_json_atomic(path, data)


def run_remote_code(config: Any, name_or_path: Any, hub_kwargs: dict[str, Any]) -> None:
    """``trust_remote_code=True`` on a folder this plugin saved: import its ``hf_kernel_attn_model.py`` the way
    transformers' auto classes do (``get_class_from_dynamic_module``), which imports the kernel modules the
    checkpoint ships. Nothing else of the folder runs."""
    auto_map = getattr(config, "auto_map", None)
    refs = [auto_map[auto] for auto in ours(auto_map)]
    if not refs:
        return
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    allowed = ("cache_dir", "revision", "token", "local_files_only")
    get_class_from_dynamic_module(refs[0], str(name_or_path), **{k: v for k, v in hub_kwargs.items() if k in allowed})


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
    write_json_atomic(path, data)
