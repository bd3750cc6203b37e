"""Loading a checkpoint runs no code it was not trusted to run.

A downloaded kernel checkpoint's config.json names the module that defines its kernel
(``kernel_attention.modules``). Three such modules: (a) one outside the folder with a side effect (the
standard library's ``this`` prints the Zen of Python; ``site_kernels`` writes a marker file), (b) a file
inside the checkpoint folder, (c) one that does not exist. Every load runs in a fresh process started in the
working directory that contains the folder (so ``downloaded_model.evil`` is importable from there), and
whether a module ran is read from its real side effect, not from the code under test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hf_kernel_attn
from tests.paths import REPO

ROOT = REPO
ZEN = "Beautiful is better than ugly"

KERNEL_SOURCE = textwrap.dedent('''
    """A user kernel (elu+1 feature map under another name) whose import leaves a marker file."""
    import os
    import torch
    import hf_kernel_attn

    with open(os.path.join(os.environ["MARKER_DIR"], __name__ + ".ran"), "w") as f:
        f.write("imported")


    @hf_kernel_attn.register_kernel
    class Zzz(hf_kernel_attn.FeatureMapKernel):
        name = "zzz"

        def feature_map(self, x):
            return torch.nn.functional.elu(x) + 1
''')

LOAD = """
import sys, torch
{imports}
from transformers import AutoModelForCausalLM
model = {call}
ids = torch.arange(3, 23).view(1, 20)
with torch.no_grad():
    print("LOGITS", model(ids).logits[0, -1, :4].tolist())
"""


def _run(code: str, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


@pytest.fixture
def layout(tmp_path, tiny_llama):
    """work/downloaded_model: tiny Llama saved with the built-in elu kernel, then its config pointed at kernel
    'zzz'; work/downloaded_model/evil.py defines zzz (case b); site/site_kernels.py defines zzz too and is on
    PYTHONPATH (case a, a module outside the folder)."""
    work = tmp_path / "work"
    folder = work / "downloaded_model"
    model = hf_kernel_attn.from_pretrained(tiny_llama, kernel="elu")
    model.save_pretrained(folder)
    shutil.copy(tiny_llama / "tokenizer.json", folder)
    shutil.copy(tiny_llama / "tokenizer_config.json", folder)
    (folder / "evil.py").write_text(KERNEL_SOURCE)
    site = tmp_path / "site"
    site.mkdir()
    (site / "site_kernels.py").write_text(KERNEL_SOURCE)
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "MARKER_DIR": str(markers),
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    return work, folder, markers, env


def _name_module(folder: Path, module: str) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["kernel_attention"]["kernel"] = "zzz"
    cfg["kernel_attention"]["modules"] = {"zzz": module}
    path.write_text(json.dumps(cfg, indent=2))


CASES = {"a-stdlib": "this", "a-site": "site_kernels", "b-in-folder": "{folder}.evil",
         "c-missing": "no_such_module_anywhere"}

TRY_ALL = """
import json, sys, traceback
import hf_kernel_attn
from transformers import AutoModelForCausalLM
out = []
for folder in sys.argv[1:]:
    for name, load in [("stock", AutoModelForCausalLM.from_pretrained), ("plugin", hf_kernel_attn.from_pretrained)]:
        try:
            load(folder)
            out.append([folder, name, "loaded", ""])
        except Exception as exc:
            out.append([folder, name, type(exc).__name__, str(exc)])
print("RESULTS", json.dumps(out))
"""


def test_loading_without_consent_imports_nothing(layout):
    """Each case in its own copy of the folder, all loaded by stock transformers (after ``import
    hf_kernel_attn``) and by ``hf_kernel_attn.from_pretrained`` in one process: none imports its module."""
    work, folder, markers, env = layout
    modules = {}
    for case, module in sorted(CASES.items()):
        copy = work / f"case_{case.replace('-', '_')}"
        shutil.copytree(folder, copy)
        modules[copy.name] = module.format(folder=copy.name)
        _name_module(copy, modules[copy.name])
    run = _run(TRY_ALL, work, env, *modules)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ZEN not in run.stdout and not list(markers.iterdir()), "a module named by the checkpoint ran"
    results = json.loads(run.stdout.split("RESULTS", 1)[1])
    assert len(results) == 2 * len(CASES)
    for copy, how, kind, message in results:
        module = modules[copy]
        assert kind == "KernelModuleError", (copy, how, kind, message)
        assert "'zzz'" in message and repr(module) in message and "kernel_modules" in message, message
        assert "never imports a module because a checkpoint names it" in message


def test_consent_by_name_loads_a_module_outside_the_folder(layout):
    work, folder, markers, env = layout
    _name_module(folder, "site_kernels")
    call = "hf_kernel_attn.from_pretrained('downloaded_model', kernel_modules=['site_kernels'])"
    run = _run(LOAD.format(imports="import hf_kernel_attn", call=call), work, env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "LOGITS" in run.stdout and [p.name for p in markers.iterdir()] == ["site_kernels.ran"]
    # the user's own import is consent too, for stock transformers calls
    for p in markers.iterdir():
        p.unlink()
    run = _run(LOAD.format(imports="import hf_kernel_attn, site_kernels",
                           call="AutoModelForCausalLM.from_pretrained('downloaded_model')"), work, env)
    assert run.returncode == 0, run.stderr[-2000:]
    # the standard library module is imported when named (the Zen is printed), then found not to define zzz
    _name_module(folder, "this")
    call = "hf_kernel_attn.from_pretrained('downloaded_model', kernel_modules=['this'])"
    run = _run(LOAD.format(imports="import hf_kernel_attn", call=call), work, env)
    assert ZEN in run.stdout and run.returncode != 0
    assert "does not define the kernel" in run.stderr
    # a module that does not exist: named, it is reported as not importable
    _name_module(folder, "no_such_module_anywhere")
    call = "hf_kernel_attn.from_pretrained('downloaded_model', kernel_modules=['no_such_module_anywhere'])"
    run = _run(LOAD.format(imports="import hf_kernel_attn", call=call), work, env)
    assert run.returncode != 0 and "cannot import module 'no_such_module_anywhere'" in run.stderr


def test_a_module_in_the_checkpoint_folder_runs_only_with_trust_remote_code(layout):
    work, folder, markers, env = layout
    _name_module(folder, "downloaded_model.evil")
    call = "hf_kernel_attn.from_pretrained('downloaded_model', kernel_modules=['downloaded_model.evil'])"
    run = _run(LOAD.format(imports="import hf_kernel_attn", call=call), work, env)
    assert run.returncode != 0 and not list(markers.iterdir())
    assert "inside the model folder" in run.stderr and "trust_remote_code=True" in run.stderr, run.stderr[-1500:]
    call = ("hf_kernel_attn.from_pretrained('downloaded_model', kernel_modules=['downloaded_model.evil'], "
            "trust_remote_code=True)")
    run = _run(LOAD.format(imports="import hf_kernel_attn", call=call), work, env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [p.name for p in markers.iterdir()] == ["downloaded_model.evil.ran"]


def test_cli_refuses_then_takes_consent(layout):
    work, folder, markers, env = layout
    text = work / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    script = str(Path(sys.executable).parent / "hf-kernel-attn")  # the console script a user runs
    base = [script, "perplexity", "--model", "downloaded_model", "--kernels", "saved", "--data-file", str(text),
            "--block-size", "32", "--max-tokens", "64"]

    def cli(*extra):
        return subprocess.run([*base, *extra], capture_output=True, text=True, cwd=work, env=env, timeout=300)

    _name_module(folder, "this")
    run = cli()
    assert run.returncode == 2 and ZEN not in run.stdout, run.stderr[-1500:]
    assert run.stderr.startswith("error:") and "--import this" in run.stderr and "Traceback" not in run.stderr
    _name_module(folder, "downloaded_model.evil")
    run = cli("--import", "downloaded_model.evil")
    assert run.returncode == 2 and not list(markers.iterdir())
    assert "inside the model folder" in run.stderr and "--trust-remote-code" in run.stderr
    run = cli("--import", "downloaded_model.evil", "--trust-remote-code")
    assert run.returncode == 0, run.stderr[-2000:]
    assert [p.name for p in markers.iterdir()] == ["downloaded_model.evil.ran"]


def test_saved_kernel_module_ships_and_loads_under_trust_remote_code(tmp_path, tiny_llama, monkeypatch):
    """A kernel from a top-level module of the author's: the checkpoint carries a copy of the module, its
    remote-code file names it, and a consumer without the module loads it only with trust_remote_code=True,
    through stock transformers or the plugin, to the same logits."""
    author = tmp_path / "author"
    author.mkdir()
    (author / "author_kernels.py").write_text(KERNEL_SOURCE)
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("MARKER_DIR", str(markers))
    monkeypatch.syspath_prepend(str(author))
    try:
        import author_kernels  # noqa: F401

        model = hf_kernel_attn.from_pretrained(tiny_llama, kernel="zzz").eval()
        out = tmp_path / "consumer" / "shipped_model"
        model.save_pretrained(out)
        ids = torch.arange(3, 23).view(1, 20)
        with torch.no_grad():
            want = model(ids).logits[0, -1, :4].tolist()
    finally:
        hf_kernel_attn.KERNELS.pop("zzz", None)
        sys.modules.pop("author_kernels", None)
    for p in markers.iterdir():  # the author's own import
        p.unlink()
    assert (out / "author_kernels.py").read_text() == KERNEL_SOURCE
    remote = (out / "hf_kernel_attn_model.py").read_text()
    assert "author_kernels.py from this folder (kernel 'zzz')" in remote
    for name in ("config.json", "hf_kernel_attn_model.py", "author_kernels.py"):
        assert (out / name).stat().st_mode & 0o777 == 0o644, name
    env = {**os.environ, "MARKER_DIR": str(markers), "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    work = out.parent
    # without trust: nothing of the folder runs, the error says how to allow it
    run = _run(LOAD.format(imports="import hf_kernel_attn",
                           call="AutoModelForCausalLM.from_pretrained('shipped_model')"), work, env)
    assert run.returncode != 0 and not list(markers.iterdir()) and "'author_kernels'" in run.stderr
    for imports, call in [
        ("", "AutoModelForCausalLM.from_pretrained('shipped_model', trust_remote_code=True)"),
        ("import hf_kernel_attn", "hf_kernel_attn.from_pretrained('shipped_model', trust_remote_code=True)"),
    ]:
        run = _run(LOAD.format(imports=imports, call=call), work, env)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.split("LOGITS", 1)[1].strip())
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
        assert [p.name.endswith("author_kernels.ran") for p in markers.iterdir()] == [True]
        for p in markers.iterdir():
            p.unlink()
