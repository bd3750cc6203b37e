"""Conversion training (``hf-kernel-attn finetune``) on tiny models: config errors, the transfer
objective, resume after SIGKILL, 2-process accelerate, the saved model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import hf_kernel_attn
from hf_kernel_attn import events
from hf_kernel_attn.integration.transfer import attention_transfer, softmax_teacher
from hf_kernel_attn.training import ConfigError, load_config
from tests.paths import DATA, REPO
from tests.training import fault_injection
from tests.training.fault_injection import sleep_at
from tests.training.helpers import SHAKESPEARE, STSB, lm_config, read_log, write_config  # noqa: F401

SST2 = DATA / "sst2" / "train.tsv"
CLI = [sys.executable, "-m", "hf_kernel_attn.cli"]
ACCELERATE_2CPU = REPO / "configs" / "accelerate" / "cpu-2proc.yaml"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args, env_extra=None, check=True, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


# ------------------------------------------------------------------------------------------ config


def test_config_defaults_and_overrides(tmp_path):
    path = write_config(tmp_path / "c.yaml", lm_config("m", tmp_path / "o", kernel_params={"feature_dim": 8}))
    cfg = load_config(path, ["stages.transfer.lr=0.5", "data.seq_len=128", "kernel_params.eps=1e-9",
                             "layers=[0]", "stages.full.max_minutes=2.5"])
    assert cfg["stages"]["transfer"]["lr"] == 0.5 and cfg["data"]["seq_len"] == 128
    assert cfg["kernel_params"] == {"feature_dim": 8, "eps": 1e-9}  # --set adds to the file's options
    assert cfg["layers"] == [0] and cfg["stages"]["full"]["max_minutes"] == 2.5
    assert cfg["stages"]["lora"]["r"] == 8 and cfg["stages"]["lora"]["alpha"] == 16  # LoLCATs defaults


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stages.transfer.stpes=3", "did you mean 'stages.transfer.steps'"),
        ("ouput_dir=x", "did you mean 'output_dir'"),
        ("data.batchsize=3", "did you mean 'data.batch_size'"),
        ("stages.lora.alpah=3", "did you mean 'stages.lora.alpha'"),
        ("task=lm", "task must be one of"),
        ("kernel=gauss", "unknown kernel 'gauss'"),
        ("kernel_params.feature_dimm=3", "unknown option"),
        ("data.seq_len=0", "data.seq_len must be an integer >= 1"),
        ("stages.transfer.schedule=cos", "schedule must be one of"),
        ("stages.transfer.max_minutes=-1", "max_minutes must be > 0"),
        ("stages.transfer.loss=kl", "stages.transfer.loss must be one of"),
        ("budget_clock=gpu", "budget_clock must be one of"),
        ("mixed_precision=fp8", "mixed_precision must be one of \\['no', 'bf16', 'fp16'\\]"),
        ("bf16=2", "bf16 must be true or false"),
        ("sharding=zero3", "sharding must be one of \\['none', 'fsdp'\\]"),
        ("sharding=fsdp", "sharding: fsdp shards the full stage"),
        ("gradient_checkpointing=1", "gradient_checkpointing must be true or false"),
        ("config_overrides=3", "config_overrides must be a mapping"),
        ("lr_scheduler_type=cosine_restarts", "schedule must be one of"),
        ("hub_model_id=a/b/c", "hub_model_id must be 'owner/name' or 'name'"),
        ("push_to_hub=maybe", "push_to_hub must be true or false"),
        ("stages=3", "is a section"),
        ("novalue", "--set expects KEY=VALUE"),
        ("inference_params=3", "inference_params must be a mapping"),
        ("inference_params.sparse_cache=8", "inference_params: sparse_cache=8 needs a window"),
        ("inference_layers=3", "inference_layers must be a mapping"),
        ("inference_layers.x={sinks: 2}", "inference_layers: keys are layer indices"),
        ("inference_layers.1=4", "inference_layers.1 must be a mapping of kernel options"),
        ("inference_layers.1={sparse_cache: 4}", "inference_layers.1: sparse_cache=4 needs a window"),
    ],
)
def test_config_errors(tmp_path, override, message):
    path = write_config(tmp_path / "c.yaml", lm_config("m", tmp_path / "o"))
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])


def test_training_arguments_names(tmp_path):
    """transformers.TrainingArguments names set the keys they stand for; a top-level stage name sets every stage
    that runs, a stage-level one that stage; the resolved config (what is saved) holds only the real keys."""
    path = write_config(tmp_path / "c.yaml", lm_config("m", tmp_path / "o", **{"stages.lora.lr_scheduler_type":
                                                                                "cosine"}))
    cfg = load_config(path, ["learning_rate=3e-4", "max_steps=5", "warmup_steps=1", "per_device_train_batch_size=2",
                             "gradient_accumulation_steps=3", "bf16=true", "save_steps=7", "save_total_limit=4",
                             "report_to=none", "stages.transfer.learning_rate=0.02"])
    stages = cfg["stages"]
    assert [stages[s]["steps"] for s in ("transfer", "distill", "lora", "full")] == [5, 0, 5, 0]
    assert stages["transfer"]["lr"] == 3e-4 and stages["lora"]["lr"] == 3e-4  # top level: every running stage
    assert stages["full"]["lr"] == 2e-5 and stages["full"]["warmup_steps"] == 0  # a stage that does not run
    assert stages["lora"]["schedule"] == "cosine" and stages["transfer"]["warmup_steps"] == 1
    assert (cfg["data"]["batch_size"], cfg["data"]["grad_accum"], cfg["mixed_precision"]) == (2, 3, "bf16")
    assert (cfg["save_every"], cfg["keep_checkpoints"], cfg["log_with"]) == (7, 4, "none")
    assert not {"learning_rate", "max_steps", "bf16", "per_device_train_batch_size"} & set(cfg)
    assert load_config(path, ["mixed_precision=no"])["mixed_precision"] == "no"  # YAML's `no` is false


def test_gradient_checkpointing_and_bf16_runs(tiny_llama, tmp_path):
    """gradient_checkpointing recomputes the same forward: the same losses as without, step by step; bf16 autocast
    trains every stage (transfer, distill, LoRA) to losses within a few percent of fp32, and saves fp32 weights."""
    common = {"stages.distill.steps": 2, "stages.distill.lr": 1e-3, "stages.lora.steps": 2, "stages.transfer.steps": 2}
    logs = {}
    for name, extra in {"plain": {}, "ckpt": {"gradient_checkpointing": True},
                        "bf16": {"mixed_precision": "bf16"}}.items():
        cfg = lm_config(tiny_llama, tmp_path / name, **common, **extra)
        run_cli(["finetune", str(write_config(tmp_path / f"{name}.yaml", cfg))])
        logs[name] = [r["loss"] for r in read_log(tmp_path / name)]
    assert len(logs["plain"]) == 6
    assert logs["ckpt"] == pytest.approx(logs["plain"], abs=1e-5)
    assert logs["bf16"] == pytest.approx(logs["plain"], rel=0.05)
    assert logs["bf16"] != logs["plain"]  # autocast did run
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "bf16" / "final" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_config_errors_files_and_required(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    cfg = lm_config("m", tmp_path / "o")
    del cfg["model"]
    with pytest.raises(ConfigError, match="'model' is required"):
        load_config(write_config(tmp_path / "c.yaml", cfg))
    cfg = lm_config("m", tmp_path / "o")
    cfg["stages"] = {"transfer": {"steps": 0}, "lora": {"steps": 0}}
    with pytest.raises(ConfigError, match="nothing to train"):
        load_config(write_config(tmp_path / "c.yaml", cfg))
    cfg = lm_config("m", tmp_path / "o", task="sequence_classification")
    with pytest.raises(ConfigError, match="data.glue_task"):
        load_config(write_config(tmp_path / "c.yaml", cfg))


def test_cli_reports_config_errors(tmp_path):
    path = write_config(tmp_path / "c.yaml", lm_config("m", tmp_path / "o"))
    proc = run_cli(["finetune", str(path), "--set", "stages.trasnfer.steps=1"], check=False)
    assert proc.returncode == 2 and "did you mean 'stages.transfer'" in proc.stderr


# ------------------------------------------------------------------------------- transfer objective


def test_transfer_passes_the_softmax_output_on(tiny_llama):
    """Inside attention_transfer every layer returns the softmax teacher's output, so the whole model
    computes the original model's logits (checked against the unpatched model), and each recorded
    loss is the MSE between that layer's kernel and softmax outputs."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    hf_kernel_attn.patch(model, kernel="hedgehog")
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = plain(ids).logits
        kernel_logits = model(ids).logits
        with attention_transfer() as rec:
            teacher_logits = model(ids).logits
        with softmax_teacher():
            softmax_logits = model(ids).logits
    torch.testing.assert_close(teacher_logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(softmax_logits, expected, atol=1e-5, rtol=1e-5)
    assert (kernel_logits - expected).abs().max() > 1e-3  # the kernel itself differs
    assert len(rec.losses) == 2 and all(float(x.detach()) > 0 for x in rec.losses)


def test_transfer_loss_is_layer_mse(tiny_llama):
    """The recorded loss of layer 0 equals an independent computation: capture q, k, v at the layer
    and compare softmax (brute force) with the hedgehog brute-force reference."""
    from transformers import AutoModelForCausalLM

    from tests.kernels import reference as ref

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    hf_kernel_attn.patch(model, kernel="hedgehog", layers=[0])
    kern = model.model.layers[0].self_attn.kernel_attn
    captured = {}
    original = type(kern).forward

    def spy(self, q, k, v, **kw):
        captured.update(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(), scaling=kw["scaling"])
        return original(self, q, k, v, **kw)

    ids = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(1))
    type(kern).forward = spy
    try:
        with torch.no_grad(), attention_transfer() as rec:
            model(ids)
    finally:
        type(kern).forward = original
    assert len(rec.losses) == 1  # layer 1 runs softmax: nothing to transfer
    q, k, v, s = captured["q"], captured["k"], captured["v"], captured["scaling"]
    teacher = ref.per_head_softmax_ref(q, k, v, torch.full((q.shape[1],), s, dtype=torch.float64))
    student = ref.hedgehog_ref(kern, q, k, v, scaling=s)
    assert float(rec.losses[0].detach()) == pytest.approx(float((student - teacher).pow(2).mean()), rel=1e-4)


def test_transfer_trains_only_kernel_parameters(tiny_llama, tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(
        tiny_llama, tmp_path / "o", kernel="gaussian", kernel_params={"projection": "full"},
        **{"stages.lora.steps": 0, "stages.transfer.steps": 30, "stages.transfer.lr": 0.05})))
    from transformers import AutoModelForCausalLM

    from hf_kernel_attn.training import Trainer

    final = Trainer(cfg).run()
    log = read_log(tmp_path / "o")
    assert [r["step"] for r in log] == list(range(1, 31))
    for key in ("stage", "step", "loss", "lr", "tokens", "seconds", "cpu_seconds"):
        assert key in log[0]
    assert log[-1]["tokens"] == 30 * 4 * 32
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    trained = AutoModelForCausalLM.from_pretrained(final)  # stock loader after `import hf_kernel_attn`
    assert trained.config.kernel_attention["kernel"] == "gaussian"
    assert trained.config.kernel_attention["params"] == {"projection": "full"}
    base_sd, trained_sd = base.state_dict(), trained.state_dict()
    for name, value in trained_sd.items():
        if ".kernel_attn." in name:
            continue
        torch.testing.assert_close(value, base_sd[name], atol=0, rtol=0)  # frozen
    proj = trained.model.layers[0].self_attn.kernel_attn.projection
    assert not torch.allclose(proj.q, torch.eye(8).expand_as(proj.q))
    # on text none of the steps saw, the transfer loss fell
    hf_kernel_attn.patch(base, kernel="gaussian", projection="full")
    ids = torch.randint(0, 5000, (4, 32), generator=torch.Generator().manual_seed(3))
    losses = []
    for model in (base, trained):
        with torch.no_grad(), attention_transfer() as rec:
            model.eval()(ids)
        losses.append(rec.mean())
    assert losses[1] < 0.5 * losses[0]


def test_kernel_without_parameters_skips_transfer(tiny_llama, tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(tiny_llama, tmp_path / "o", kernel="elu")))
    from hf_kernel_attn.training import Trainer

    Trainer(cfg).run()
    log = read_log(tmp_path / "o")
    assert {r["stage"] for r in log} == {"lora"} and len(log) == 4


def test_inference_params_reach_the_saved_model_only(tiny_llama, tmp_path):
    """inference_params are added to the saved kernel after training (the run itself trains without them): the
    final model loads with a sparse cache and gives the outputs of the trained weights patched with it."""
    import hf_kernel_attn
    from hf_kernel_attn.training import Trainer

    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(
        tiny_llama, tmp_path / "o", kernel_params={"window": 8, "sinks": 2}, inference_params={"sparse_cache": 4})))
    final = Trainer(cfg).run()
    model = hf_kernel_attn.from_pretrained(final).eval()
    cfg_saved = hf_kernel_attn.kernel_config(model)
    assert cfg_saved.params == {"window": 8, "sinks": 2, "sparse_cache": 4}
    assert "sparse_cache" not in json.dumps(read_log(tmp_path / "o"))
    plain = hf_kernel_attn.from_pretrained(final, kernel="hedgehog", kernel_params={"window": 8, "sinks": 2}).eval()
    ids = torch.randint(5, 500, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse_out, plain_out = model(ids).logits, plain(ids).logits
    hf_kernel_attn.patch(plain, kernel="hedgehog", window=8, sinks=2, sparse_cache=4)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, sparse_out, rtol=0, atol=0)
    assert not torch.allclose(plain_out, sparse_out)


def test_inference_layers_reach_those_saved_layers_only(tiny_llama, tmp_path):
    """inference_layers add options to one layer of the saved model (on top of inference_params): layer 1 becomes
    a retrieval layer on a budget (every query head softmax over sinks, window and cached pairs) with more sinks,
    layer 0 keeps the common options; the final model gives the logits of the trained weights patched with that
    per-layer choice by hand, and other logits than without the layer options."""
    import hf_kernel_attn
    from hf_kernel_attn.training import Trainer

    common = {"window": 8, "sinks": 2}
    layer1 = {"sinks": 6, "softmax_heads": [0, 1, 2, 3]}
    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(
        tiny_llama, tmp_path / "o", kernel_params=common, inference_params={"sparse_cache": 4},
        inference_layers={1: layer1})))
    final = Trainer(cfg).run()
    saved = json.loads((final / "config.json").read_text())["kernel_attention"]
    assert saved["params"] == {**common, "sparse_cache": 4}
    assert saved["layers"]["1"]["params"] == {**common, "sparse_cache": 4, **layer1}
    model = hf_kernel_attn.from_pretrained(final).eval()
    by_hand = hf_kernel_attn.from_pretrained(final, kernel="hedgehog", kernel_params=common).eval()
    hf_kernel_attn.patch(by_hand, kernel="hedgehog", layers={
        0: {"kernel": "hedgehog", "params": {**common, "sparse_cache": 4}},
        1: {"kernel": "hedgehog", "params": {**common, "sparse_cache": 4, **layer1}}})
    by_hand.load_state_dict(model.state_dict())
    uniform = hf_kernel_attn.from_pretrained(final, kernel="hedgehog", kernel_params={**common, "sparse_cache": 4})
    uniform.load_state_dict(model.state_dict())
    ids = torch.randint(5, 500, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids).logits
        torch.testing.assert_close(by_hand(ids).logits, out, rtol=0, atol=0)
        assert not torch.allclose(uniform.eval()(ids).logits, out)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_budget_clock(tiny_llama, tmp_path, clock):
    """max_minutes = 0.6 s with 0.4 s of sleep before each step: the wall clock ends the stage by step 2;
    the CPU clock does not count the sleep (a busy machine's waiting), so all 4 steps run."""
    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(
        tiny_llama, tmp_path / "o", kernel="elu", budget_clock=clock,
        **{"stages.lora.steps": 4, "stages.lora.max_minutes": 0.6 / 60, "validate": False})))
    from hf_kernel_attn.training import Trainer

    stop = events.listen(sleep_at("begin-step-", 0.4))
    try:
        Trainer(cfg).run()
    finally:
        stop()
    log = read_log(tmp_path / "o")
    assert len(log) <= 2 if clock == "wall" else len(log) == 4
    assert all(r["cpu_seconds"] > 0 for r in log)


# ----------------------------------------------------------------------------------- resume / kill


def _final_loss(out: Path) -> float:
    return read_log(out)[-1]["loss"]


@pytest.mark.slow(28)
def test_resume_after_sigkill_equals_uninterrupted_run(tiny_llama, tmp_path):
    """Transfer, distillation (killed here), then LoRA on the distillation's adapters."""
    cfg = lm_config(tiny_llama, tmp_path / "ref", **{"stages.transfer.steps": 5, "stages.distill.steps": 3,
                                                      "stages.distill.lr": 1e-3, "stages.lora.steps": 3,
                                                      "save_every": 2})
    run_cli(["finetune", str(write_config(tmp_path / "ref.yaml", cfg))])
    reference = read_log(tmp_path / "ref")
    assert [r["stage"] for r in reference] == ["transfer"] * 5 + ["distill"] * 3 + ["lora"] * 3

    # 1) SIGKILL mid-run (after step 7 is logged, inside the distill stage), then --resume
    out = tmp_path / "killed"
    cfg["output_dir"] = str(out)
    path = write_config(tmp_path / "killed.yaml", cfg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # slow steps down so the kill lands mid-run
    proc = subprocess.Popen(fault_injection.command("finetune", str(path), sleep={"begin-step-": 0.5}), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log_file = out / "training_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if log_file.exists() and len(log_file.read_text().splitlines()) >= 7:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    run_cli(["finetune", str(path), "--resume"])
    resumed = read_log(out)
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for a, b in zip(resumed, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["tokens"] == b["tokens"]


def test_kill_while_writing_a_checkpoint(tiny_llama, tmp_path):
    """SIGKILL in the middle of a checkpoint write leaves only a temporary folder, which --resume
    ignores and removes; the run then finishes with the uninterrupted run's loss."""
    cfg = lm_config(tiny_llama, tmp_path / "ref", **{"stages.transfer.steps": 4, "stages.lora.steps": 4,
                                                      "save_every": 2})
    run_cli(["finetune", str(write_config(tmp_path / "ref.yaml", cfg))])
    out = tmp_path / "killed"
    cfg["output_dir"] = str(out)
    path = write_config(tmp_path / "killed.yaml", cfg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # a 30 s window after the first checkpoint's first file
    proc = subprocess.Popen(fault_injection.command("finetune", str(path), sleep={"save-2-optimizer.pt": 30}),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(out.glob(".tmp-checkpoint-*/*.pt")):
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(out.glob(".tmp-checkpoint-*")), "the kill should land inside the first checkpoint write"
    assert not list(out.glob("checkpoint-*"))
    run_cli(["finetune", str(path), "--resume"])
    assert not list(out.glob(".tmp-checkpoint-*"))
    assert _final_loss(out) == pytest.approx(_final_loss(tmp_path / "ref"), abs=1e-4)
    assert [r["step"] for r in read_log(out)] == list(range(1, 9))


def test_existing_run_needs_resume(tiny_llama, tmp_path):
    cfg = lm_config(tiny_llama, tmp_path / "o", **{"stages.lora.steps": 0, "stages.transfer.steps": 2})
    path = write_config(tmp_path / "c.yaml", cfg)
    run_cli(["finetune", str(path)])
    proc = run_cli(["finetune", str(path)], check=False)
    assert proc.returncode == 2 and "--resume" in proc.stderr
    assert (tmp_path / "o" / "final").exists()  # nothing was lost


def test_missing_training_file_is_a_clear_error(tiny_llama, tmp_path):
    cfg = lm_config(tiny_llama, tmp_path / "o")
    cfg["data"]["train"] = [str(tmp_path / "nope.txt")]
    proc = run_cli(["finetune", str(write_config(tmp_path / "c.yaml", cfg))], check=False)
    assert proc.returncode == 2 and "nope.txt" in proc.stderr


# ------------------------------------------------------------------------------------ distributed


@pytest.mark.slow(25)
def test_two_processes_equal_one(tiny_llama, tmp_path):
    """accelerate launch with 2 CPU processes (batch 2 each) vs 1 process (batch 4): same global
    batch, equal loss after 20 steps (transfer, distillation, LoRA) within 1e-3."""
    common = {"stages.transfer.steps": 10, "stages.distill.steps": 4, "stages.distill.lr": 1e-3,
              "stages.lora.steps": 6, "save_every": 0}
    one = lm_config(tiny_llama, tmp_path / "one", **common)
    run_cli(["finetune", str(write_config(tmp_path / "one.yaml", one))])
    two = lm_config(tiny_llama, tmp_path / "two", **common)
    two["data"]["batch_size"] = 2
    path = write_config(tmp_path / "two.yaml", two)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_2CPU),
         "--main_process_port", str(_free_port()), "-m", "hf_kernel_attn.cli", "finetune", str(path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert len(a) == len(b) == 20
    assert b[-1]["tokens"] == a[-1]["tokens"]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-4)


def _torchrun(args: list[str], kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script = fault_injection.command(*args, kill=kill)[1:]  # tests/training/fault_injection.py [--kill-at X] -- args
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), *script],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow(50)
def test_fsdp_full_fine_tune_of_minilm_equals_one_process(minilm_dir, tmp_path):
    """torchrun, 2 processes, sharding: fsdp (torch's fully_shard over gloo): each process holds half of
    MiniLM's parameters, every step's loss equals the 1-process run's within 1e-4 (dropout off: its masks
    are drawn per process), and a run killed after its step-2 checkpoint resumes to the same steps and weights."""
    from safetensors.torch import load_file

    cfg = {"model": str(minilm_dir), "task": "sentence_embedding", "kernel": "gaussian",
           "config_overrides": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
           "data": {"train": [str(STSB)], "glue_task": "stsb", "seq_len": 48, "batch_size": 8,
                    "validation_batches": 1},
           "stages": {"full": {"steps": 4, "lr": 5e-5, "warmup_steps": 1, "schedule": "cosine", "max_grad_norm": 1.0}},
           "save_every": 2, "output_dir": str(tmp_path / "one"), "log_with": "none", "validate": False}
    run_cli(["finetune", str(write_config(tmp_path / "one.yaml", cfg))])
    cfg.update(output_dir=str(tmp_path / "two"), sharding="fsdp")
    cfg["data"]["batch_size"] = 4
    path = str(write_config(tmp_path / "two.yaml", cfg))
    killed = _torchrun(["finetune", path], kill="step-3")
    assert killed.returncode != 0 and (tmp_path / "two" / "checkpoint-2").is_dir(), killed.stderr[-3000:]
    held = [ln for ln in killed.stdout.splitlines() if ln.startswith("sharding: fsdp: process")]
    assert len(held) == 2
    for line in held:
        local, total = [int(w) for w in line.split() if w.isdigit()][-2:]
        assert abs(local / total - 0.5) < 0.01
    resumed = _torchrun(["finetune", path, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-4)
        assert x["tokens"] == y["tokens"]
    w1, w2 = load_file(tmp_path / "one" / "final" / "model.safetensors"), \
        load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
    saved = json.loads((tmp_path / "two" / "final" / "config.json").read_text())
    assert saved["architectures"] == ["BertModel"] and saved["kernel_attention"]["kernel"] == "gaussian"


# ------------------------------------------------------------------------------------ encoder tasks


def test_sentence_embedding_distillation(tiny_bert, tmp_path):
    """The teacher targets are the original model's mean-pooled embeddings (checked against the
    unpatched model), and cosine distillation lowers the loss."""
    import statistics

    cfg = {
        "model": str(tiny_bert), "task": "sentence_embedding", "kernel": "elu",
        "data": {"train": [str(STSB)], "glue_task": "stsb", "seq_len": 32, "batch_size": 8,
                 "validation_batches": 4},
        "stages": {"full": {"steps": 60, "lr": 1e-4}},
        "output_dir": str(tmp_path / "o"), "log_with": "none", "save_every": 0,
    }
    from transformers import AutoModel, AutoTokenizer

    from hf_kernel_attn.training import Trainer

    trainer = Trainer(load_config(write_config(tmp_path / "c.yaml", cfg)))
    final = trainer.run()
    losses = [r["loss"] for r in read_log(tmp_path / "o")]
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10])
    val = [json.loads(ln) for ln in (tmp_path / "o" / "validation.jsonl").read_text().splitlines()]
    assert [v["stage"] for v in val] == ["start", "full"] and "val_spearman" in val[-1]
    plain, tok = AutoModel.from_pretrained(tiny_bert).eval(), AutoTokenizer.from_pretrained(tiny_bert)
    used = trainer.teacher.abs().sum(-1).nonzero().flatten()[:5].tolist()
    assert len(used) == 5
    for i in used:
        enc = tok(trainer.train.items[i], return_tensors="pt")
        with torch.no_grad():
            expected = plain(**enc).last_hidden_state.mean(1)[0]
        torch.testing.assert_close(trainer.teacher[i], expected, atol=1e-5, rtol=1e-4)
    model = AutoModel.from_pretrained(final)
    assert model.config.kernel_attention["kernel"] == "elu"


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_sequence_classification(tiny_bert, tmp_path, precision):
    """Transfer then LoRA on SST-2; under bf16 autocast too, after which the model's forward is its class's again
    (transformers' decorators included: PEFT's classification wrapper passes return_dict)."""
    cfg = {"mixed_precision": precision,
        "model": str(tiny_bert), "task": "sequence_classification", "kernel": "gaussian",
        "data": {"train": [str(SST2)], "glue_task": "sst2", "seq_len": 32, "batch_size": 8,
                 "validation_batches": 4},
        "stages": {"transfer": {"steps": 2}, "lora": {"steps": 4, "lr": 1e-3}},
        "output_dir": str(tmp_path / "o"), "log_with": "none", "save_every": 0,
    }
    from transformers import AutoModelForSequenceClassification

    from hf_kernel_attn.training import Trainer

    final = Trainer(load_config(write_config(tmp_path / "c.yaml", cfg))).run()
    assert [r["stage"] for r in read_log(tmp_path / "o")] == ["transfer"] * 2 + ["lora"] * 4
    val = [json.loads(ln) for ln in (tmp_path / "o" / "validation.jsonl").read_text().splitlines()]
    assert "val_accuracy" in val[-1]
    model = AutoModelForSequenceClassification.from_pretrained(final)
    assert model.config.num_labels == 2 and model.config.kernel_attention["kernel"] == "gaussian"
    assert yaml.safe_load((tmp_path / "o" / "config.resolved.yaml").read_text())["mixed_precision"] == precision


def test_a_task_of_ones_own_is_one_module(tiny_llama, tmp_path, monkeypatch):
    """A TrainingTask subclass registered in a module the config imports is the run's task: its loss (here twice
    the causal LM loss) is what the first step logs, against a stock causal_lm run of the same samples."""
    (tmp_path / "double_lm.py").write_text(
        "from hf_kernel_attn.training import register_task\n"
        "from hf_kernel_attn.training.tasks.causal_lm import CausalLMTask\n\n\n"
        "@register_task\nclass DoubleLM(CausalLMTask):\n    name = 'double_lm'\n\n"
        "    def loss(self, model, batch):\n        return 2 * super().loss(model, batch)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from hf_kernel_attn.training import Trainer
    from hf_kernel_attn.training.tasks import TASK_TYPES

    common = {"stages.transfer.steps": 0, "stages.lora.steps": 1, "validate": False}
    try:
        for name, extra in {"plain": {}, "double": {"task": "double_lm", "imports": ["double_lm"]}}.items():
            cfg = lm_config(tiny_llama, tmp_path / name, **common, **extra)
            Trainer(load_config(write_config(tmp_path / f"{name}.yaml", cfg))).run()
    finally:
        TASK_TYPES.pop("double_lm", None)
    assert read_log(tmp_path / "double")[0]["loss"] == pytest.approx(2 * read_log(tmp_path / "plain")[0]["loss"],
                                                                      rel=1e-5)
    with pytest.raises(ConfigError, match="task must be one of"):
        load_config(write_config(tmp_path / "bad.yaml", lm_config(tiny_llama, tmp_path / "x", task="double_lm")))


def _first_cli_loss(tiny_llama, tmp_path, name, overrides, sets=()):
    """The first logged loss of a 1-step `hf-kernel-attn finetune` run of the tiny Llama (no transfer)."""
    cfg = lm_config(tiny_llama, tmp_path / name, **{"stages.transfer.steps": 0, "validate": False, "save_every": 0,
                                                    **overrides})
    run_cli(["finetune", str(write_config(tmp_path / f"{name}.yaml", cfg)), *sets], cwd=REPO)
    assert (tmp_path / name / "final" / "config.json").is_file()
    return read_log(tmp_path / name)[0]


def test_a_stage_of_ones_own_runs_from_the_cli(tiny_llama, tmp_path):
    """`hf-kernel-attn finetune` with `imports: [tests.custom_stage]` runs `scaled_kernel` (weight × the task loss):
    its first loss is weight × a stock run's first loss on the same samples (LoRA starts as the identity)."""
    own = _first_cli_loss(tiny_llama, tmp_path, "own", {"imports": ["tests.custom_stage"], "stages.lora.steps": 0,
                                                        "stages.scaled_kernel.steps": 1},
                          ["--set", "stages.scaled_kernel.weight=3"])
    plain = _first_cli_loss(tiny_llama, tmp_path, "plain", {"stages.lora.steps": 1})
    assert own["stage"] == "scaled_kernel"
    assert own["loss"] == pytest.approx(3 * plain["loss"], rel=1e-5)


def test_a_task_of_ones_own_runs_from_the_cli(tiny_llama, tmp_path):
    """`hf-kernel-attn finetune` with `imports: [tests.custom_task]` and `task: double_lm_cli` (twice the causal
    LM loss): its first loss is twice a stock run's on the same samples."""
    own = _first_cli_loss(tiny_llama, tmp_path, "own", {"imports": ["tests.custom_task"], "task": "double_lm_cli",
                                                        "stages.lora.steps": 1})
    plain = _first_cli_loss(tiny_llama, tmp_path, "plain", {"stages.lora.steps": 1})
    assert own["loss"] == pytest.approx(2 * plain["loss"], rel=1e-5)
