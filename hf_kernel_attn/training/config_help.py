"""Every finetune config key with its type, default and help, read from the dataclasses of :mod:`.config_fields`:
the text of ``hf-kernel-attn finetune --help-config`` and the key table of docs/training.md."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from dataclasses import dataclass
from typing import Any

from .config_fields import BudgetConfig, DataConfig, KernelConfig, ModelConfig, OutputConfig, StageConfig
from .config_fields import stage_config_class as _stage_class
from .config_schema import field_defaults
from .stages import stage_names

TOP_LEVEL = (ModelConfig, KernelConfig, BudgetConfig, OutputConfig)


@dataclass(frozen=True)
class KeyHelp:
    """One config key as the help shows it."""

    key: str  # dotted, e.g. data.seq_len; stages.<name>.lr for a key every stage has
    type: str
    default: str  # as YAML writes it; per stage where the stages' defaults differ
    help: str
    section: str  # the dataclass's first docstring line


def yaml_value(value: Any) -> str:
    """``value`` as it is written in the YAML file (null, true, [], a bare string)."""
    return value if isinstance(value, str) else json.dumps(value)


def _section(cls: type) -> str:
    """``ClassName: the docstring's first line``."""
    return f"{cls.__name__}: {(cls.__doc__ or '').strip().splitlines()[0]}"


def _rows(cls: type, prefix: str = "") -> list[KeyHelp]:
    values = field_defaults(cls)
    return [KeyHelp(f"{prefix}{f.name}", str(f.type), yaml_value(values[f.name]), f.metadata.get("help", ""),
                    _section(cls)) for f in dataclasses.fields(cls)]


def _per_stage(values: dict[str, Any]) -> str:
    """One default, or each stage's (``transfer: 0.01, lora: 0.0001``) where they differ."""
    shown = {name: yaml_value(value) for name, value in values.items()}
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    return ", ".join(f"{name}: {value}" for name, value in shown.items())


def _stage_rows() -> list[KeyHelp]:
    """The keys every stage has (``stages.<name>.KEY``, each stage's default), then each stage's own keys
    (``stages.{distill,lora}.r`` where several stages share one)."""
    classes = {name: _stage_class(name) for name in stage_names()}
    stage_defaults = {name: field_defaults(cls) for name, cls in classes.items()}
    section = _section(StageConfig)
    rows = []
    for f in dataclasses.fields(StageConfig):
        default = _per_stage({name: values[f.name] for name, values in stage_defaults.items()})
        rows.append(KeyHelp(f"stages.<name>.{f.name}", str(f.type), default, f.metadata["help"], section))
    common = {f.name for f in dataclasses.fields(StageConfig)}
    own: dict[str, dict[str, dataclasses.Field]] = {}
    for name, cls in classes.items():
        for f in dataclasses.fields(cls):
            if f.name not in common:
                own.setdefault(f.name, {})[name] = f
    for key, by_stage in own.items():
        names = list(by_stage)
        where = names[0] if len(names) == 1 else "{" + ",".join(names) + "}"
        first = next(iter(by_stage.values()))
        default = _per_stage({name: stage_defaults[name][key] for name in names})
        rows.append(KeyHelp(f"stages.{where}.{key}", str(first.type), default, first.metadata.get("help", ""),
                            section))
    return rows


def config_keys() -> list[KeyHelp]:
    """Every key of the config: the top-level groups, ``data``, ``stages`` (the stages registered now)."""
    rows = [row for cls in TOP_LEVEL for row in _rows(cls)]
    return [*rows, *_rows(DataConfig, "data."), *_stage_rows()]


def help_text(width: int = 100) -> str:
    """The ``--help-config`` text: each section, then each key as ``key: type = default`` and its help."""
    lines = ["The keys of a finetune config file (YAML), as KEY: TYPE = DEFAULT and their meaning.",
             "--set KEY=VALUE overrides any key (dotted keys reach into data and stages); transformers",
             "TrainingArguments names (learning_rate, max_steps, bf16, ...) are read as the keys they stand for."]
    section = None
    for row in config_keys():
        if row.section != section:
            section = row.section
            lines += ["", f"{section}"]
        lines.append(f"  {row.key}: {row.type} = {row.default}")
        lines += textwrap.wrap(row.help, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The config keys as a Markdown table (docs/training.md)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for row in config_keys():
        rows.append(f"| `{row.key}` | `{_cell(row.type)}` | `{_cell(row.default)}` | {_cell(row.help)} |")
    return "\n".join(rows)
