"""The kernel registry: one class per name. Built-in kernels are added by :mod:`hf_kernel_attn.kernels`; users add
theirs with ``hf_kernel_attn.register_kernel`` (which also registers the name with transformers)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import json
import re
import sys
from pathlib import Path

from ..registry import Registry
from .base import Kernel, KernelOptions

KERNELS: Registry[type[Kernel]] = Registry(
    "kernel", Kernel, hint="a kernel of your own: register it with hf_kernel_attn.register_kernel, and load its "
    "module first, e.g. with --import MODULE")
BUILTIN_PACKAGE = "hf_kernel_attn."
REMOTE_PACKAGE = "transformers_modules."  # where transformers imports a model's own code
KINDS = ("softmax-like", "linear", "gated", "delta", "nystrom")
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


def add_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Add ``cls`` under ``cls.name``; re-adding the same class, or the same definition (a module executed twice),
    is fine, another class under a taken name is not (:class:`hf_kernel_attn.registry.Registry`). Raises a
    ValueError naming the problem for anything that cannot work as a kernel."""
    if not isinstance(cls, type) or not issubclass(cls, Kernel):
        raise ValueError(f"register_kernel takes a subclass of hf_kernel_attn.Kernel (a FeatureMapKernel for a "
                         f"feature map), got {cls!r}")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{cls.__qualname__} needs a class attribute name: a lower-case identifier such as "
                         f"'sqrelu' (letters, digits, '_' or '-'), got {name!r}")
    if name == "saved":
        raise ValueError("'saved' is reserved (it means a checkpoint's own kernel on the command line)")
    opts = cls.options_cls
    if not (dataclasses.is_dataclass(opts) and issubclass(opts, KernelOptions)):
        raise ValueError(f"{cls.__qualname__}.options_cls must be a dataclass subclassing KernelOptions "
                         f"(e.g. LinearOptions for a feature map), got {opts!r}")
    if cls.kind not in KINDS:
        raise ValueError(f"{cls.__qualname__}.kind must be one of {list(KINDS)}, got {cls.kind!r}")
    KERNELS.register(name, cls)
    return cls


def causal_only_kernels() -> list[str]:
    """Names of the registered kernels that cannot run bidirectionally (encoders)."""
    return sorted(n for n, c in KERNELS.items() if not c.supports_bidirectional)


def sparse_cache_kernels() -> list[str]:
    """Names of the registered kernels whose option ``sparse_cache`` works (feature maps without a decay)."""
    return sorted(n for n, c in KERNELS.items() if getattr(c, "supports_sparse_cache", False))


def kernel_class(name: str) -> type[Kernel]:
    """The class registered as ``name``; an :class:`~hf_kernel_attn.registry.UnknownNameError` (a ValueError)
    listing the kernels otherwise."""
    return KERNELS.get(name)


def is_builtin(name: str) -> bool:
    return kernel_class(name).__module__.startswith(BUILTIN_PACKAGE)


def defining_module(name: str) -> str | None:
    """The module that defines a user kernel (None for the built-in ones): what a checkpoint records. A module
    that transformers loaded from a checkpoint's own files (``trust_remote_code``; named
    ``transformers_modules.<folder>.<file>``) is recorded by its file's name, the name it was saved under."""
    if is_builtin(name):
        return None
    module = kernel_class(name).__module__
    return module.rsplit(".", 1)[-1] if module.startswith(REMOTE_PACKAGE) else module


class KernelModuleError(ValueError):
    """A kernel's module cannot be imported, or may not be: the message names the kernel, the module and how to
    allow it."""


def _model_folder(directory: Path) -> Path | None:
    """``directory`` when it holds a transformers model's ``config.json`` (one with ``model_type`` or
    ``architectures``), else None."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return directory if isinstance(data, dict) and ("model_type" in data or "architectures" in data) else None


def model_folder_of(module: str) -> Path | None:
    """The model folder (a directory holding a model's ``config.json``) that the file of ``module``, or of one
    of its parent packages, lies in; None when there is none or the module cannot be found. The files are
    located with :class:`importlib.machinery.PathFinder` without importing anything: no code runs here."""
    locations: list[str] | None = None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            origin = getattr(loaded, "__file__", None)
            search = list(getattr(loaded, "__path__", []) or [])
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, locations)
            if spec is None:
                return None
            origin = spec.origin if spec.has_location else None
            search = list(spec.submodule_search_locations or [])
        places = [Path(origin).parent] if origin else [Path(p) for p in search]
        for place in places:
            folder = _model_folder(place)
            if folder is not None:
                return folder
        locations = search
    return None


def import_modules(modules: list[str] | tuple[str, ...], where: str = "--import",
                   trust_remote_code: bool = False) -> None:
    """Import each module (which registers its kernels); a :class:`KernelModuleError` naming the module when one
    cannot be imported. A module not yet imported whose file lies in a model folder (code shipped with a
    checkpoint) is refused unless ``trust_remote_code``, the rule transformers applies to a model's own code."""
    for module in modules:
        if not isinstance(module, str) or not module:
            raise KernelModuleError(f"{where}: a module name (e.g. my_kernels), got {module!r}")
        if module not in sys.modules and not trust_remote_code:
            folder = model_folder_of(module)
            if folder is not None:
                raise KernelModuleError(
                    f"{where}: module {module!r} is a file inside the model folder {str(folder)!r}: code shipped "
                    "with a checkpoint runs only with trust_remote_code=True (--trust-remote-code on the command "
                    "line), as transformers requires for a model's own code; read it first")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise KernelModuleError(
                f"{where}: cannot import module {module!r} ({type(exc).__name__}: {exc}); it must be importable "
                "from this process (installed, or on PYTHONPATH / the working directory)") from None
