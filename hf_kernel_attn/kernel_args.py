"""Ground floor: the one command-line syntax for kernel options, shared by every command (``eval``,
``perplexity``, ``decode-bench``, ``bench``, ``diagnose``'s and ``lm-eval``'s kernel arguments).

* A kernel is ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (``hedgehog:window=64,sinks=4``).
* ``--param KEY=VALUE`` (repeatable) gives an option to every kernel the command names except the softmax
  baseline; ``--param NAME.KEY=VALUE`` to kernel NAME only (softmax included).
* A value is JSON where it parses (``64``, ``true``, ``[0, 3]``, ``{"a": 1}``), else the string itself.

Options written inside a kernel spec win over ``--param NAME.KEY``, which wins over ``--param KEY``. Standard
library only: the CLI parses its arguments before torch is imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

SYNTAX = "a kernel is NAME or NAME:KEY=VALUE,...; --param takes KEY=VALUE (every kernel) or NAME.KEY=VALUE"
SAVED = "saved"  # as a kernel spec of perplexity and decode-bench: the kernels the model was saved with, as loaded


def parse_value(text: str) -> Any:
    """JSON where ``text`` parses as JSON, else ``text``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_kernel_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` -> (NAME, options); ValueError naming the bad part."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"kernel {spec!r}: no kernel name before ':' ({SYNTAX})")
    options: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"kernel {spec!r}: expected name:key=value,key=value, got the part {part!r} ({SYNTAX})")
        options[key] = parse_value(value)
    return name, options


def format_kernel_spec(name: str, options: dict[str, Any]) -> str:
    """(NAME, options) -> ``NAME`` or ``NAME:KEY=VALUE,...`` (values as JSON), which :func:`parse_kernel_spec` reads
    back."""
    if not options:
        return name
    return name + ":" + ",".join(f"{key}={json.dumps(value)}" for key, value in options.items())


def parse_param(item: str) -> tuple[str | None, str, Any]:
    """``KEY=VALUE`` -> (None, KEY, value); ``NAME.KEY=VALUE`` -> (NAME, KEY, value)."""
    target, eq, value = item.partition("=")
    if not eq or not target or target.startswith(".") or target.endswith("."):
        raise ValueError(f"--param expects KEY=VALUE or KERNEL.KEY=VALUE, got {item!r}")
    kernel, dot, key = target.rpartition(".")
    return (kernel if dot else None), key, parse_value(value)


def parse_params(items: Iterable[str] | None) -> dict[str | None, dict[str, Any]]:
    """``--param`` items -> {None: options for every kernel, NAME: options for NAME only}."""
    out: dict[str | None, dict[str, Any]] = {}
    for item in items or []:
        kernel, key, value = parse_param(item)
        out.setdefault(kernel, {})[key] = value
    return out


def kernel_options(name: str, inline: dict[str, Any], params: dict[str | None, dict[str, Any]], *,
                   softmax: str) -> dict[str, Any]:
    """The options of kernel ``name``: ``--param KEY`` (unless ``name`` is ``softmax``, the baseline:
    :data:`hf_kernel_attn.kernels.SOFTMAX`), then ``--param NAME.KEY``, then the spec's own ``inline`` options."""
    general = {} if name == softmax else params.get(None, {})
    return {**general, **params.get(name, {}), **inline}


def check_param_targets(params: dict[str | None, dict[str, Any]], names: Iterable[str]) -> None:
    """ValueError when ``--param NAME.KEY`` names a kernel the command does not run."""
    names = list(names)
    stray = sorted(k for k in params if k is not None and k not in names)
    if stray:
        raise ValueError(f"--param names kernel(s) {stray} that this command does not run; it runs {names}")


def resolve_kernels(specs: Iterable[str], items: Iterable[str] | None, *,
                    softmax: str) -> list[tuple[str, dict[str, Any]]]:
    """Kernel specs and ``--param`` items -> [(NAME, options)] in the order given (see the module docstring)."""
    parsed = [parse_kernel_spec(s) for s in specs]
    params = parse_params(items)
    check_param_targets(params, [name for name, _ in parsed])
    return [(name, kernel_options(name, inline, params, softmax=softmax)) for name, inline in parsed]
