"""Kernels of one's own: ``register_kernel``, ``FeatureMapKernel``, the conformance kit
``hf_kernel_attn.testing.check_kernel``, ``--import`` / ``imports:``, and checkpoints that reload with their
kernel's module (imported with the user's consent, ``kernel_modules=``). The user kernel lives in
tests/custom_kernels.py and uses only the public API."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import hf_kernel_attn
from hf_kernel_attn.cli import main
from hf_kernel_attn.kernels import KERNELS, LayerShape, LinearKernel, SoftmaxKernel
from hf_kernel_attn.testing import check_kernel
from tests.paths import REPO

ROOT = REPO
MODULE = "tests.custom_kernels"


@pytest.fixture
def custom_kernels():
    """tests/custom_kernels.py imported (its kernels registered) for one test, unregistered afterwards, so that
    the rest of the suite sees only the built-in kernels."""
    module = importlib.reload(sys.modules[MODULE]) if MODULE in sys.modules else importlib.import_module(MODULE)
    yield module
    KERNELS.pop("sqrelu", None)


# ------------------------------------------------------------------------------------------ conformance kit
BUILTIN = [n for n in KERNELS if KERNELS[n].__module__.startswith("hf_kernel_attn.")]


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_kernels_pass_the_conformance_kit(name):
    errors = check_kernel(name)
    assert any("decoding" in f for f in errors) == KERNELS[name].supports_causal
    assert any(f.startswith("gradients") for f in errors) and any("key padding" in f for f in errors)


def test_outside_kernels_pass_the_conformance_kit(custom_kernels):
    errors = check_kernel("sqrelu")
    assert any("window=5" in f for f in errors)  # the sliding-window hybrid came with the feature map

    class DPFP(hf_kernel_attn.FeatureMapKernel):  # unregistered: check_kernel takes the class too
        name = "dpfp"

        def feature_map(self, x):
            r = torch.cat([torch.relu(x), torch.relu(-x)], -1)
            return r * r.roll(1, -1)

    check_kernel(DPFP)


class _ForgetsPadding(SoftmaxKernel):
    name = "forgets-padding"

    def forward(self, q, k, v, *, key_mask=None, **kw):
        return super().forward(q, k, v, key_mask=None, **kw)


class _ForgetsState(hf_kernel_attn.FeatureMapKernel):
    name = "forgets-state"

    def feature_map(self, x):
        return torch.relu(x) + 0.1

    def forward_with_state(self, q, k, v, *, past=None, **kw):
        return super().forward_with_state(q, k, v, past=None, **kw)


class _HalfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class _WrongBackward(hf_kernel_attn.FeatureMapKernel):
    name = "wrong-backward"

    def feature_map(self, x):
        return torch.relu(_HalfGradient.apply(x)) + 0.1


class _NotBrute(hf_kernel_attn.FeatureMapKernel):
    """Its forward is elu's, but its definition says relu: the kit compares the fast paths with the definition."""

    name = "not-brute"

    def feature_map(self, x):
        return torch.relu(x) + 0.1

    def feature(self, x, pos, scaling):
        return torch.nn.functional.elu(x) + 1


@pytest.mark.parametrize("cls, form", [(_ForgetsPadding, "key padding"), (_ForgetsState, "decoding"),
                                       (_WrongBackward, "gradients")])
def test_conformance_kit_names_the_failing_form(cls, form):
    with pytest.raises(AssertionError, match=rf"check_kernel\('{cls.name}'\): [^:]*{form}"):
        check_kernel(cls)


def test_conformance_kit_checks_against_the_definition():
    class Wrong(LinearKernel):  # fast paths from one map, definition (scores) from another
        name = "wrong"

        def feature(self, x, pos, scaling):
            return torch.relu(x) + 0.1

        def scores(self, q, k, scaling):
            return super().scores(q, k, scaling) + 1.0

    with pytest.raises(AssertionError, match="check_kernel\\('wrong'\\)"):
        check_kernel(Wrong)


# ------------------------------------------------------------------------------------------------ registry
def test_register_kernel_errors(custom_kernels):
    with pytest.raises(ValueError, match="subclass of hf_kernel_attn.Kernel"):
        hf_kernel_attn.register_kernel(object)

    class NoName(hf_kernel_attn.FeatureMapKernel):
        def feature_map(self, x):
            return x

    with pytest.raises(ValueError, match="needs a class attribute name"):
        hf_kernel_attn.register_kernel(NoName)

    class Clash(hf_kernel_attn.FeatureMapKernel):
        name = "hedgehog"

    with pytest.raises(ValueError, match="'hedgehog' is already registered by hf_kernel_attn.kernels"):
        hf_kernel_attn.register_kernel(Clash)

    class BadKind(hf_kernel_attn.FeatureMapKernel):
        name = "bad-kind"
        kind = "quantum"

    with pytest.raises(ValueError, match="kind must be one of"):
        hf_kernel_attn.register_kernel(BadKind)
    info = hf_kernel_attn.available_kernels()["sqrelu"]
    assert info["kind"] == "linear" and info["module"] == MODULE and "window" in info["options"]


def test_unknown_kernel_error_points_at_register_kernel():
    with pytest.raises(ValueError, match="register it with hf_kernel_attn.register_kernel"):
        hf_kernel_attn.kernels.kernel_class("nosuch")


# --------------------------------------------------------------------------------------- save and reload
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


LOAD_AND_PRINT = """
import json, sys, torch
import hf_kernel_attn
model = hf_kernel_attn.from_pretrained(sys.argv[1], kernel_modules=sys.argv[2:]).eval()
ids = torch.arange(3, 43).view(2, 20) % 128
with torch.no_grad():
    print(json.dumps(model(ids).logits.double().flatten().tolist()))
"""


def test_checkpoint_with_an_outside_kernel_reloads_in_a_new_process(custom_kernels, tmp_path):
    model = hf_kernel_attn.patch(_tiny_llama(), kernel="sqrelu", window=4)
    with torch.no_grad():  # trained-looking parameters, so the reload must carry them
        for layer in model.model.layers:
            layer.self_attn.kernel_attn.scale.mul_(torch.linspace(0.5, 1.5, 8))
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())["kernel_attention"]
    assert saved["modules"] == {"sqrelu": MODULE}
    ids = torch.arange(3, 43).view(2, 20) % 128
    with torch.no_grad():
        want = model(ids).logits.double().flatten()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", LOAD_AND_PRINT, str(tmp_path / "m"), MODULE], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    torch.testing.assert_close(torch.tensor(json.loads(run.stdout.splitlines()[-1]), dtype=torch.float64), want,
                               rtol=0, atol=0)
    # a checkpoint whose kernel module is gone says which module and which kernel
    saved["modules"] = {"sqrelu": "no_such_kernels_module"}
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["kernel_attention"] = saved
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    run = subprocess.run([sys.executable, "-c", LOAD_AND_PRINT, str(tmp_path / "m")], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert run.returncode != 0  # never imported on the checkpoint's word: the error says how to allow it
    assert "'sqrelu' (module 'no_such_kernels_module')" in run.stderr and "kernel_modules=" in run.stderr


def test_cli_import(custom_kernels, capsys):
    KERNELS.pop("sqrelu")  # --import registers it again
    sys.modules.pop(MODULE)
    assert main(["list", "--import", MODULE]) == 0
    assert "sqrelu         linear" in capsys.readouterr().out
    assert main(["--import", "no_such_kernels_module", "list"]) == 2
    assert "cannot import module 'no_such_kernels_module'" in capsys.readouterr().err


# --------------------------------------------------------------- a real model: MiniLM, end to end by the CLI
def test_outside_kernel_converts_evaluates_and_benchmarks_minilm(custom_kernels, minilm_dir, tmp_path, capsys):
    """sqrelu (hybrid with a 16-token window) through `finetune` (imports: in the YAML), `eval`, a leaderboard
    cell and `bench`, all with --import; the converted checkpoint reloads with its trained scale."""
    import yaml

    data = ROOT.parent / "shared" / "data"
    cfg = {"model": str(minilm_dir), "task": "sentence_embedding", "kernel": "sqrelu", "imports": [MODULE],
           "kernel_params": {"window": 16},
           "data": {"train": [str(data / "stsb" / "train.tsv")], "glue_task": "stsb", "seq_len": 64,
                    "batch_size": 8, "validation_batches": 2, "max_train_chars": 20000},
           "stages": {"transfer": {"steps": 3, "lr": 1.0e-2}, "full": {"steps": 2, "lr": 1.0e-5}},
           "threads": 1, "save_every": 0, "output_dir": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    KERNELS.pop("sqrelu")  # the YAML's imports: registers it
    sys.modules.pop(MODULE)
    assert main(["finetune", str(tmp_path / "c.yaml")]) == 0
    final = tmp_path / "out" / "final"
    from transformers import AutoModel

    model = AutoModel.from_pretrained(final)
    scale = model.encoder.layer[0].attention.self.kernel_attn.scale
    assert not torch.equal(scale, torch.ones_like(scale))  # attention transfer trained the user's parameter
    records = tmp_path / "eval.jsonl"
    assert main(["eval", "--import", MODULE, "--model", str(final), "--tasks", "stsb_embedding", "--data-dir",
                 str(data), "--limit", "16", "--output", str(records)]) == 0
    row = json.loads(records.read_text().splitlines()[-1])
    assert row["kernel"] == "sqrelu" and -100 <= row["value"] <= 100
    board = {"imports": [MODULE], "output_dir": str(tmp_path / "board"), "data_dir": str(data),
             "limit": {"stsb_embedding": 8},
             "models": [{"name": "minilm", "model": str(minilm_dir), "kernels": ["softmax", "sqrelu"],
                         "tasks": ["stsb_embedding"]}]}
    (tmp_path / "board.yaml").write_text(yaml.safe_dump(board))
    assert main(["leaderboard", str(tmp_path / "board.yaml")]) == 0
    cells = [json.loads(x) for x in (tmp_path / "board" / "results.jsonl").read_text().splitlines()]
    assert {(c["kernel"], c.get("status", "ok")) for c in cells} >= {("sqrelu", "ok"), ("softmax", "ok")}
    assert "sqrelu" in (tmp_path / "board" / "leaderboard.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--import", MODULE, "--kernels", "sqrelu", "--lengths", "64", "--causal", "--no-peak",
                 "--repeats", "1", "--heads", "2", "--head-dim", "16", "--output", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    timed = [r for r in rows if r["kernel"] == "sqrelu"]
    assert timed and timed[0]["status"] == "ok" and timed[0]["kind"] == "linear" and timed[0]["gflops"] > 0


def test_shape_probe_of_a_feature_map(custom_kernels):
    kern = hf_kernel_attn.kernels.build_kernel("sqrelu", LayerShape(4, 2, 8))
    assert kern.num_features() == 8


def test_gated_kernels_with_scalar_and_per_feature_gates_pass_the_kit():
    """A gate of one value per head (broadcast over the features) and one per feature, through the public
    GatedKernel base: every form against the brute force of its scores (e^{-|b_i - b_j|} weights)."""
    from hf_kernel_attn.kernels import GatedKernel

    class ScalarGate(GatedKernel):
        name = "scalar-gate"

        def feature(self, x, pos, scaling):
            return torch.nn.functional.elu(x) + 1

        def log_gate(self, k, scaling):
            return torch.nn.functional.logsigmoid(k.mean(-1, keepdim=True) + 1.0)

    class FeatureGate(ScalarGate):
        name = "feature-gate"

        def log_gate(self, k, scaling):
            return torch.nn.functional.logsigmoid(2 * k)

    for cls in (ScalarGate, FeatureGate):
        errors = check_kernel(cls)
        assert any("window=5" in f for f in errors) and any("decoding" in f for f in errors)
