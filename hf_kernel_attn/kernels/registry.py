"""The kernel registry: one class per name. Built-in kernels are added by :mod:`hf_kernel_attn.kernels`; users add
theirs with ``hf_kernel_attn.register_kernel`` (which also registers the name with transformers)."""

from __future__ import annotations

import dataclasses
import importlib
import re

from .base import Kernel, KernelOptions

KERNELS: dict[str, type[Kernel]] = {}
BUILTIN_PACKAGE = "hf_kernel_attn."
KINDS = ("softmax-like", "linear", "gated", "nystrom")
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


def add_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Add ``cls`` under ``cls.name``; re-adding the same class (a module imported twice) is a no-op. Raises a
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
    previous = KERNELS.get(name)
    if previous is not None and previous is not cls:
        same_source = (previous.__module__, previous.__qualname__) == (cls.__module__, cls.__qualname__)
        if not same_source:
            raise ValueError(f"kernel name {name!r} is already registered by {previous.__module__}."
                             f"{previous.__qualname__}; choose another name")
    opts = cls.options_cls
    if not (dataclasses.is_dataclass(opts) and issubclass(opts, KernelOptions)):
        raise ValueError(f"{cls.__qualname__}.options_cls must be a dataclass subclassing KernelOptions "
                         f"(e.g. LinearOptions for a feature map), got {opts!r}")
    if cls.kind not in KINDS:
        raise ValueError(f"{cls.__qualname__}.kind must be one of {list(KINDS)}, got {cls.kind!r}")
    KERNELS[name] = cls
    return cls


def kernel_class(name: str) -> type[Kernel]:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; available kernels: {sorted(KERNELS)} (a kernel of your own: "
                         "register it with hf_kernel_attn.register_kernel, and load its module first, e.g. with "
                         "--import MODULE)")
    return KERNELS[name]


def is_builtin(name: str) -> bool:
    return kernel_class(name).__module__.startswith(BUILTIN_PACKAGE)


def defining_module(name: str) -> str | None:
    """The module that defines a user kernel (None for the built-in ones): what a checkpoint records."""
    return None if is_builtin(name) else kernel_class(name).__module__


def import_modules(modules: list[str] | tuple[str, ...], where: str = "--import") -> None:
    """Import each module (which registers its kernels); a ValueError naming the module when one cannot be
    imported."""
    for module in modules:
        if not isinstance(module, str) or not module:
            raise ValueError(f"{where}: a module name (e.g. my_kernels), got {module!r}")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"{where}: cannot import module {module!r} ({type(exc).__name__}: {exc}); it must be "
                             "importable from this process (installed, or on PYTHONPATH / the working directory)"
                             ) from None
