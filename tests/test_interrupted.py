"""Interrupted runs (issue 12): SIGKILL at seeded random points of a training run (mid-step, mid-log-line,
mid-checkpoint, between the renames), a leaderboard sweep killed while it adds a cell to results.jsonl, and a
disk that fills up while a checkpoint or the final model is written.

Kills are real SIGKILLs of a forked copy of the test process (the package is already imported there, so a
run costs its training steps, not the imports); a listener on the run's named points
(``hf_kernel_attn.training.events``, ``tests/fault_injection.kill_at``) kills the copy at the chosen one."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import yaml

from hf_kernel_attn.training import checkpoint as ckpt
from hf_kernel_attn.training import events, load_config

from .fault_injection import kill_at

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHAKESPEARE = DATA / "tinyshakespeare" / "train.txt"
FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "rng.pt", ckpt.STATE_FILE)
TRANSFER, LORA, SAVE_EVERY = 3, 3, 2


def train_config(model: Path, out: Path, tmp_path: Path) -> dict:
    cfg = {
        "model": str(model), "task": "causal_lm", "kernel": "hedgehog",
        "data": {"train": [str(SHAKESPEARE)], "max_train_chars": 20000, "seq_len": 32, "batch_size": 4},
        "stages": {"transfer": {"steps": TRANSFER}, "lora": {"steps": LORA, "lr": 1e-3}},
        "save_every": SAVE_EVERY, "keep_checkpoints": 2, "output_dir": str(out), "log_with": "none",
        "validate": False,
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def run_forked(fn, crash: str | None = None, timeout: float = 180.0) -> int:
    """Run ``fn()`` in a forked child that kills itself at point ``crash``; returns the child's wait status
    as a negative signal number (killed) or its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: one thread (no OpenMP pool inherited across fork), then the run
        code = 0
        try:
            if crash:
                events.listen(kill_at(crash))
            torch.set_num_threads(1)
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"forked run did not finish in {timeout} s (crash point {crash!r})")
        time.sleep(0.05)


def finetune(cfg: dict, resume: bool = False):
    from hf_kernel_attn.training import Trainer

    return Trainer(cfg, resume=resume).run()


def read_log(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "training_log.jsonl").read_text().splitlines()]


def assert_same_run(out: Path, ref: Path) -> None:
    got, want = read_log(out), read_log(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, TRANSFER + LORA + 1))
    for a, b in zip(got, want, strict=True):
        assert (a["stage"], a["tokens"]) == (b["stage"], b["tokens"])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
    from safetensors.torch import load_file

    final, expected = load_file(out / "final" / "model.safetensors"), load_file(ref / "final" / "model.safetensors")
    assert sorted(final) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, atol=1e-4, rtol=1e-4)


def assert_checkpoints_complete(out: Path) -> list[int]:
    """Every checkpoint a resume could pick is whole: all files present and loadable, state at its step."""
    steps = []
    for step, path in ckpt.checkpoints(out):
        assert sorted(p.name for p in path.iterdir()) == sorted(FILES), path
        for name in FILES[:-1]:
            ckpt.load_file(path, name)
        assert ckpt.read_state(path)["global_step"] == step
        steps.append(step)
    return steps


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run (model folder, output folder)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "ref"
    finetune(train_config(tiny_llama, out, tmp))
    return tiny_llama, out


# ------------------------------------------------------------------------------ training: SIGKILL


def crash_sites() -> dict[str, list[str]]:
    """Every point of the run where a kill is planted, in run order, by kind."""
    saves = [s for s in range(1, TRANSFER + LORA + 1) if s % SAVE_EVERY == 0 or s in (TRANSFER, TRANSFER + LORA)]
    return {
        "step": [f"{kind}-{s}" for s in range(1, TRANSFER + LORA + 1) for kind in ("step", "log")],
        "checkpoint": [f"save-{s}-{name}" for s in saves for name in FILES] + [f"rename-{s}" for s in saves],
        "after": [f"prune-{s}" for s in saves] + ["final"],
    }


def _order(site: str) -> tuple[int, int]:
    """Run order of a crash site: (step, position within the step)."""
    if site == "final":
        return (10**6, 0)
    kind, step, *rest = site.split("-", 2)
    within = {"step": 0, "log": 1, "save": 2, "rename": 3, "prune": 4}[kind]
    return (int(step), within * 10 + (FILES.index(rest[0]) if rest else 0))


@pytest.mark.parametrize("seed", [12, 7])
def test_sigkill_at_seeded_random_points_then_resume(reference, tmp_path, seed):
    """Three kills at points drawn (seeded) from: mid-step / mid-log-line, inside a checkpoint write, after a
    checkpoint (before pruning, before the final rename). After each kill every checkpoint is whole; the last
    --resume finishes with the uninterrupted run's log and weights."""
    model, ref = reference
    rng = random.Random(seed)
    sites = sorted((rng.choice(group) for group in crash_sites().values()), key=_order)
    out = tmp_path / "killed"
    cfg = train_config(model, out, tmp_path)
    for i, site in enumerate(sites):
        status = run_forked(lambda: finetune(cfg, resume=i > 0), crash=site)  # noqa: B023 (runs now)
        assert status == -signal.SIGKILL, f"the run should die at {site!r} (status {status})"
        steps = assert_checkpoints_complete(out)
        assert not (out / "final").exists() or site == "final"
        if site.startswith("log-"):  # died with half a line written
            assert not (out / "training_log.jsonl").read_text().endswith("\n")
        if site.startswith("save-") or site.startswith("rename-"):
            assert int(site.split("-")[1]) not in steps  # the interrupted checkpoint is never listed
            assert list(out.glob(".tmp-checkpoint-*"))
    assert run_forked(lambda: finetune(cfg, resume=True)) == 0
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".old-*"))
    assert_same_run(out, ref)


def test_every_crash_site_is_reached(reference, tmp_path, monkeypatch):
    """The sites the random test draws from exist: a run passes every one of them."""
    model, _ = reference
    seen: list[str] = []
    stop = events.listen(lambda name, **info: seen.append(name))
    try:
        finetune(train_config(model, tmp_path / "o", tmp_path))
    finally:
        stop()
    expected = [s for group in crash_sites().values() for s in group]
    assert sorted(set(expected) - set(seen)) == []


def test_killed_between_the_two_renames_keeps_the_checkpoint(tmp_path):
    """Re-saving an existing step moves the old folder aside first; a kill before the new one takes its name
    leaves .old-checkpoint-N, which remove_partial (run at every start) renames back."""
    out = tmp_path / "o"
    out.mkdir()
    state = {"global_step": 4}
    ckpt.save_checkpoint(out, 4, {"model.pt": {"w": torch.ones(2)}}, state)
    status = run_forked(lambda: ckpt.save_checkpoint(out, 4, {"model.pt": {"w": torch.zeros(2)}}, state),
                        crash="swap-4")
    assert status == -signal.SIGKILL
    assert not (out / "checkpoint-4").exists() and list(out.glob(".old-checkpoint-4-*"))
    ckpt.remove_partial(out)
    assert [s for s, _ in ckpt.checkpoints(out)] == [4]
    assert torch.equal(ckpt.load_file(out / "checkpoint-4", "model.pt")["w"], torch.ones(2))
    assert not list(out.glob(".*"))


def test_log_with_a_cut_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert ckpt.read_jsonl_lines(path) == ['{"step": 1}', '{"step": 2}']
    path.write_text('{"step": 1}\n{"step": 2}')  # a whole record without its newline is kept
    assert ckpt.read_jsonl_lines(path) == ['{"step": 1}', '{"step": 2}']
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # damage before the end is not guessed at
    with pytest.raises(ValueError, match=r"log.jsonl:2: corrupted record"):
        ckpt.read_jsonl_lines(path)


# ----------------------------------------------------------------------------- training: disk full


def _enospc_when(predicate):
    """A torch.save that writes part of the file and then fails with ENOSPC when ``predicate(path)``."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        name = getattr(f, "name", str(f))
        if predicate(str(name)):
            f.write(b"\x80\x02partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *args, **kwargs)

    return save


def test_disk_full_while_saving(reference, tmp_path, monkeypatch):
    """ENOSPC part-way through checkpoint-4 (in optimizer.pt), then while the final model is written: each
    fails with CheckpointWriteError naming the cause and the intact checkpoint, removes its partial files,
    and leaves the run resumable to the uninterrupted result."""
    model, ref = reference
    out = tmp_path / "full"
    cfg = train_config(model, out, tmp_path)
    monkeypatch.setattr(torch, "save", _enospc_when(lambda name: ".tmp-checkpoint-4-" in name
                                                     and name.endswith("optimizer.pt")))
    with pytest.raises(ckpt.CheckpointWriteError) as info:
        finetune(cfg)
    message = str(info.value)
    for fragment in ("checkpoint-4", str(out), "No space left on device (ENOSPC)", "checkpoint-3, is intact",
                     "free disk space and rerun with --resume"):
        assert fragment in message, message
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert not list(out.glob(".tmp-*"))
    assert assert_checkpoints_complete(out) == [2, 3]
    monkeypatch.undo()

    import transformers.modeling_utils as mu

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mu, "safe_save_file", full_disk)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"the final model .*ENOSPC.*checkpoint-6, is intact"):
        finetune(cfg, resume=True)
    assert not (out / "final").exists() and not list(out.glob(".tmp-*"))
    assert assert_checkpoints_complete(out) == [4, 6]
    monkeypatch.undo()
    finetune(cfg, resume=True)
    assert_same_run(out, ref)


def test_cli_reports_a_full_disk_without_a_traceback(tmp_path, monkeypatch, capsys):
    import hf_kernel_attn.training as training
    from hf_kernel_attn import cli

    def fail(config, resume=False):
        raise ckpt.write_failed("checkpoint-2", tmp_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    monkeypatch.setattr(training, "load_config", lambda path, overrides: {})
    monkeypatch.setattr(training, "finetune", fail)
    assert cli.main(["finetune", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not write checkpoint-2") and "ENOSPC" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------- leaderboard


def test_leaderboard_killed_while_adding_a_cell(tiny_llama, tmp_path):
    """A kill with the new results file half written (second cell) leaves results.jsonl as it was (one whole
    cell); the rerun keeps that cell byte for byte, computes the rest once, and cleans the temporary file."""
    from hf_kernel_attn.leaderboard.sweep import load_leaderboard_config, run_leaderboard

    data = tmp_path / "data" / "wikitext-2-raw"
    data.mkdir(parents=True)  # a short text: tokenising the whole validation file would dominate the test
    (data / "wiki.valid.raw").write_text(SHAKESPEARE.read_text()[:3000])
    cfg_path = tmp_path / "lb.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "lb"), "data_dir": str(data.parent), "context": 16, "limit": 2,
        "models": [{"name": "tiny", "model": str(tiny_llama), "kernels": ["softmax", "elu", "relu"],
                    "tasks": ["wikitext2"]}],
    }))
    cfg = load_leaderboard_config(cfg_path)
    out = tmp_path / "lb"
    results = out / "results.jsonl"
    assert run_forked(lambda: run_leaderboard(cfg), crash="append-2") == -signal.SIGKILL
    first = results.read_text()
    assert [json.loads(ln)["kernel_row"] for ln in first.splitlines()] == ["softmax", "softmax"]
    assert list(out.glob(".results.jsonl.*.tmp"))  # the half-written replacement is what the kill left
    run_leaderboard(cfg)
    text = results.read_text()
    assert text.startswith(first)
    rows = [json.loads(ln) for ln in text.splitlines()]
    cells = [(r["kernel_row"], r["metric"]) for r in rows]
    assert len(cells) == len(set(cells)) == 6
    assert {k for k, _ in cells} == {"softmax", "elu", "relu"}
    assert not list(out.glob(".*.tmp"))
    assert (out / "leaderboard.md").exists()
