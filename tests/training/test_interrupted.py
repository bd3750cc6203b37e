"""Interrupted runs: SIGKILL at seeded random points of a training run (mid-step, mid-log-line,
mid-checkpoint, between the renames), a leaderboard sweep killed while it adds a cell to results.jsonl, and a
disk that fills up while a checkpoint or the final model is written.

Kills are real SIGKILLs of a forked copy of the test process (the package is already imported there, so a
run costs its training steps, not the imports); a listener on the run's named points
(``hf_kernel_attn.events``, ``tests/fault_injection.kill_at``) kills the copy at the chosen one."""

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

from hf_kernel_attn import events
from hf_kernel_attn.training import checkpoint as ckpt
from hf_kernel_attn.training import load_config
from tests.paths import DATA, REPO
from tests.training.fault_injection import kill_at

SHAKESPEARE = DATA / "tinyshakespeare" / "train.txt"
FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "rng.pt", ckpt.STATE_FILE, ckpt.MANIFEST)
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
        for name in FILES[:-2]:
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
        "after": [f"prune-{s}" for s in saves] + [f"pruned-{k}" for k in PRUNED_AT]
                 + [f"delete-pruned-{k}" for k in PRUNED_AT] + ["save-final", "final"],
    }


# checkpoint K -> the step whose save prunes it (keep_checkpoints: 2; saves at 2, 3, 4, 6)
PRUNED_AT = {2: 4, 3: 6}


def _order(site: str) -> tuple[int, int]:
    """Run order of a crash site: (step, position within the step)."""
    if site in ("save-final", "final"):
        return (10**6, site == "final")
    if site.startswith(("pruned-", "delete-pruned-")):  # checkpoint K is pruned when K + 2 * SAVE_EVERY is saved
        step = PRUNED_AT[int(site.rsplit("-", 1)[1])]
        return (step, 50 + site.startswith("delete"))
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
        assert not (out / "final").exists()  # final/ only ever appears whole, after the last point
        if site.startswith("log-"):  # died with half a line written
            assert not (out / "training_log.jsonl").read_text().endswith("\n")
        if (site.startswith("save-") or site.startswith("rename-")) and site != "save-final":
            assert int(site.split("-")[1]) not in steps  # the interrupted checkpoint is never listed
            assert list(out.glob(".tmp-checkpoint-*"))
    assert run_forked(lambda: finetune(cfg, resume=True)) == 0
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".old-*")) and not list(out.glob(".pruned-*"))
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


def kill_at_nth(point: str, n: int):
    """SIGKILL this process the ``n``-th time it passes ``point`` (e.g. after the n-th deleted file)."""
    seen = [0]

    def listener(name: str, **info) -> None:
        if name == point:
            seen[0] += 1
            if seen[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

    return listener


def _run_killed(fn, point: str, n: int) -> int:
    def child():
        events.listen(kill_at_nth(point, n))
        fn()

    return run_forked(child)


def _folder(path: Path, tag: str) -> None:
    """A model-like folder of several files whose contents say which version it is."""
    path.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (path / name).write_text(f"{tag} {name}\n" * 50)


def _version(path: Path) -> str | None:
    """'old' / 'new' when ``path`` is that complete folder, None when absent; anything else fails."""
    if not path.exists():
        return None
    files = sorted(p.name for p in path.iterdir())
    assert files == ["README.md", "config.json", "model.safetensors", "tokenizer.json"], files
    tags = {p.read_text().split(" ", 1)[0] for p in path.iterdir()}
    assert len(tags) == 1 and all(p.read_text() == f"{next(iter(tags))} {p.name}\n" * 50 for p in path.iterdir())
    return tags.pop()


def test_sigkill_at_every_point_of_replacing_final(tmp_path):
    """final/ replaced by the trainer's function: killed before the renames, between them, and after each deleted
    file of the old folder, what carries the name final is always the old or the new complete folder (or, between
    the renames, nothing); the start of the next run (remove_partial) leaves the old one back or the new one, and
    no hidden leftovers."""
    points = [("final-start", 1), ("swap-final", 1)] + [("delete-old-final", n) for n in range(1, 5)]
    for point, n in points:
        out = tmp_path / f"{point}-{n}"
        _folder(out / "final", "old")
        _folder(out / ".tmp-final", "new")

        def replace(out=out):
            events.reached("final-start")
            ckpt.replace_folder(out / ".tmp-final", out / "final", "final")

        assert _run_killed(replace, point, n) == -signal.SIGKILL, point
        visible = _version(out / "final")
        assert visible == {"final-start": "old", "swap-final": None}.get(point, "new"), (point, n, visible)
        ckpt.remove_partial(out)
        assert _version(out / "final") == ("new" if point == "delete-old-final" else "old")
        assert [p.name for p in out.iterdir()] == ["final"], (point, n)


def test_sigkill_at_every_point_of_pruning(tmp_path):
    """Checkpoints 1-3 pruned to the newest two: killed before the rename aside and after each deleted file of
    the pruned folder, every folder named checkpoint-N is complete and loadable; the next run's remove_partial
    removes the half-deleted one and a second prune finishes the job."""
    files = {"model.pt": {"w": torch.ones(3)}, "optimizer.pt": {"s": torch.zeros(2)}}
    for n in range(0, len(files) + 3):  # 0: at the rename aside; then after each file (tensors, state, manifest)
        out = tmp_path / f"prune-{n}"
        for step in (1, 2, 3):
            ckpt.save_checkpoint(out, step, files, {"global_step": step})
        point, count = ("pruned-1", 1) if n == 0 else ("delete-pruned-1", n)
        status = _run_killed(lambda out=out: ckpt.prune(out, 2), point, count)
        assert status == -signal.SIGKILL, (point, count)
        named = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
        assert named == ["checkpoint-2", "checkpoint-3"], named
        assert assert_checkpoints_listed(out) == [2, 3]
        ckpt.remove_partial(out)
        ckpt.prune(out, 2)
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-3"]


def assert_checkpoints_listed(out: Path) -> list[int]:
    """Every folder named checkpoint-N is listed (complete), and every listed one loads."""
    listed = [s for s, _ in ckpt.checkpoints(out)]
    named = sorted(int(p.name.split("-")[1]) for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert listed == named
    for _, path in ckpt.checkpoints(out):
        for name in ("model.pt", "optimizer.pt"):
            ckpt.load_file(path, name)
        ckpt.read_state(path)
    return listed


def test_damaged_checkpoint_state_names_the_file(tmp_path, capsys):
    out = tmp_path / "o"
    ckpt.save_checkpoint(out, 2, {"model.pt": {"w": torch.ones(2)}}, {"global_step": 2})
    state = out / "checkpoint-2" / ckpt.STATE_FILE
    text = state.read_text()
    state.write_text(text.replace(":", " ", 1))  # same size: the manifest matches, the JSON does not parse
    assert [s for s, _ in ckpt.checkpoints(out)] == [2]
    with pytest.raises(ValueError, match=r"trainer_state.json' cannot be read .*delete checkpoint-2 to resume"):
        ckpt.read_state(out / "checkpoint-2")
    state.write_text(text[:-5])  # shorter: not listed as complete at all
    assert ckpt.checkpoints(out) == [] and ckpt.incomplete_checkpoints(out) == [out / "checkpoint-2"]


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


FULL_DISK_RUN = """
import json, os, shutil, subprocess, sys
from pathlib import Path
import torch
from hf_kernel_attn import events
from hf_kernel_attn.training import checkpoint as ckpt
from tests.training.test_interrupted import finetune, train_config

model, out, tmp, keep = (Path(a) for a in sys.argv[1:5])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(out)], check=True)
torch.set_num_threads(1)
cfg = train_config(model, out, tmp)
filler = out / "filler"


def fill_at(point, leave):
    # at `point`, a real file takes all but `leave` bytes of the disk: the next writes meet the kernel's ENOSPC
    def listener(name, **info):
        if name == point and not filler.exists():
            free = shutil.disk_usage(out).free
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(0, free - leave))
    return events.listen(listener)


report = []
for point, leave, resume in [("save-4-optimizer.pt", 4096, False), ("save-final", 300_000, True),
                             ("save-final", None, True), (None, None, True)]:
    if point == "save-final" and leave is None:  # room for the weights, not for the tokenizer
        leave = (out / "checkpoint-6" / "model.pt").stat().st_size + 64 * 1024
    stop = fill_at(point, leave) if point else (lambda: None)
    try:
        finetune(cfg, resume=resume)
        outcome = ["finished", ""]
    except ckpt.CheckpointWriteError as exc:
        outcome = ["CheckpointWriteError", str(exc), exc.errno, type(exc.__cause__).__name__]
    except BaseException as exc:
        outcome = [type(exc).__name__, str(exc)]
    stop()
    report.append({"point": point, "outcome": outcome,
                   "hidden": sorted(p.name for p in out.iterdir() if p.name.startswith(".")),
                   "checkpoints": [s for s, _ in ckpt.checkpoints(out)], "final": (out / "final").exists()})
    if filler.exists():
        filler.unlink()  # the user frees space
shutil.copytree(out, keep, ignore=shutil.ignore_patterns("filler"))
print("REPORT", json.dumps(report))
"""


def _namespace_root() -> list[str] | None:
    """A command prefix that runs a process as root of its own mount namespace (so it can mount a tmpfs), or
    None where this machine does not allow it."""
    import shutil
    import subprocess

    for prefix in (["unshare", "--mount", "--map-root-user"], ["unshare", "--mount"]):
        if shutil.which(prefix[0]) is None:
            return None
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"],
                               capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


def test_real_full_disk_while_saving(reference, tmp_path):
    """The output folder is a real tmpfs (in a private mount namespace). A file that takes the disk's free space
    at a named point makes the kernel refuse the writes that follow (ENOSPC — torch reports it as a
    RuntimeError, safetensors and tokenizers in their own types): in checkpoint-4's optimizer.pt, in the final
    model's weights, in its tokenizer. Each fails with CheckpointWriteError naming the folder, the cause and the
    free space, leaves no temporary folder and the newest checkpoint intact; after each the space is freed and
    the run resumed; the last resume equals the uninterrupted run."""
    import subprocess

    prefix = _namespace_root()
    if prefix is None:
        pytest.skip("this machine cannot mount a tmpfs in a private mount namespace (unshare --mount)")
    model, ref = reference
    out, keep = tmp_path / "full", tmp_path / "kept"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*prefix, sys.executable, "-c", FULL_DISK_RUN, str(model), str(out), str(tmp_path),
                          str(keep)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.split("REPORT", 1)[1])
    ckpt4, weights, tokenizer, resumed = report
    for step, what, intact in [(ckpt4, "checkpoint-4", "checkpoint-3"), (weights, "the final model", "checkpoint-6"),
                               (tokenizer, "the final model", "checkpoint-6")]:
        kind, message, code, raised = step["outcome"]
        assert kind == "CheckpointWriteError" and code == errno.ENOSPC, step
        for fragment in (f"could not write {what}", str(out), "ENOSPC", "MiB free on that disk",
                         f"{intact}, is intact", "free disk space and rerun with --resume"):
            assert fragment in message, message
        assert step["hidden"] == [] and not step["final"], step
    # what the libraries really raise on ENOSPC: a Python file write, safetensors' and tokenizers' own types
    assert [s["outcome"][3] for s in (ckpt4, weights, tokenizer)] == ["OSError", "SafetensorError", "Exception"]
    assert ckpt4["checkpoints"] == [2, 3] and weights["checkpoints"] == tokenizer["checkpoints"] == [4, 6]
    assert resumed["outcome"] == ["finished", ""] and resumed["final"] and resumed["hidden"] == []
    assert_same_run(keep, ref)


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
    from hf_kernel_attn.leaderboard.config import load_leaderboard_config
    from hf_kernel_attn.leaderboard.runner import run_leaderboard

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
