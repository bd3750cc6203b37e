"""The benchmark harness (hf_kernel_attn.speed.kernel_bench and benchmarks/kernel_bench.py) on tiny sizes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_kernel_attn.kernels import KERNELS, LayerShape, build_kernel
from hf_kernel_attn.speed.kernel_bench import (
    ROW_KEYS,
    SuiteSettings,
    bench_kernel,
    estimate_flops,
    format_table,
    machine_info,
    measure_matmul_peak,
    measure_peak_memory,
    run_suite,
)
from tests.paths import REPO

TINY = SuiteSettings(heads=2, head_dim=16, repeats=1, warmup=0)
CLI_PATH = REPO / "benchmarks" / "kernel_bench.py"


@pytest.fixture(scope="module")
def suite():
    return run_suite(["gaussian", "elu", "skyformer"], [64, 128], dataclasses.replace(TINY, causal_modes=(True, False)))


def by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_rows_have_expected_keys_and_positive_times(suite):
    # softmax (SDPA) is added first at every size, even though it was not requested
    assert len(suite) == 2 * 2 * 4
    for r in suite:
        assert set(r) == set(ROW_KEYS)
        assert r["heads"] == 2 and r["head_dim"] == 16 and r["batch"] == 1 and r["dtype"] == "float32"
    ok = by(suite, status="ok")
    assert {r["kernel"] for r in ok} == {"softmax", "gaussian", "elu", "skyformer"}
    for r in ok:
        assert r["time_s"] > 0 and r["time_ms"] == pytest.approx(r["time_s"] * 1e3)
        assert len(r["times_s"]) == 1 and r["flops"] > 0 and r["gflops"] > 0
        assert r["peak_mem_mib"] is None or r["peak_mem_mib"] >= 0


def test_ratio_is_against_softmax_of_the_same_size(suite):
    for causal in (True, False):
        for n in (64, 128):
            (sdpa,) = by(suite, kernel="softmax", n=n, causal=causal)
            assert sdpa["status"] == "ok" and sdpa["ratio_vs_sdpa"] == 1.0
            for r in by(suite, n=n, causal=causal, status="ok"):
                assert r["ratio_vs_sdpa"] == pytest.approx(r["time_s"] / sdpa["time_s"])


def test_bidirectional_only_kernel_is_skipped_in_causal_mode(suite):
    for r in by(suite, kernel="skyformer", causal=True):
        assert r["status"] == "skipped" and "bidirectional" in r["reason"]
        assert r["time_s"] is None and r["ratio_vs_sdpa"] is None
    assert all(r["status"] == "ok" for r in by(suite, kernel="skyformer", causal=False))


def test_length_limits_skip_with_a_reason():
    settings = dataclasses.replace(TINY, causal_modes=(True,), max_len_quadratic=32, max_len_linear=32,
                                   measure_memory=False)
    rows = run_suite(["gaussian", "elu"], [32, 64], settings)
    assert [(r["kernel"], r["n"], r["status"]) for r in rows] == [
        ("softmax", 32, "ok"), ("gaussian", 32, "ok"), ("elu", 32, "ok"),
        ("softmax", 64, "skipped"), ("gaussian", 64, "skipped"), ("elu", 64, "skipped"),
    ]
    assert "softmax-like length limit 32" in rows[4]["reason"]
    assert "linear length limit 32" in rows[5]["reason"]
    assert rows[5]["ratio_vs_sdpa"] is None  # no baseline at this size
    table = format_table(rows)
    assert table.count("\n") == 1 + len(rows) and "skipped" in table


def test_unknown_kernel_raises_listing_available():
    with pytest.raises(ValueError, match="available kernels") as info:
        run_suite(["softmax", "nope"], [64], TINY)
    assert "nope" in str(info.value)
    for name in KERNELS:
        assert name in str(info.value)


def test_backward_and_gqa():
    gqa = dataclasses.replace(TINY, kv_heads=1)
    row = bench_kernel("hedgehog", 64, causal=True, backward=True, settings=gqa)
    fwd = bench_kernel("hedgehog", 64, causal=True, backward=False, settings=gqa)
    assert row["status"] == "ok" and row["time_s"] > 0 and row["kv_heads"] == 1
    # 3× the forward, whose projection is [W, -W] (2·16 columns) with autograd instead of W (16) without
    batch, n, d, f, heads = 1, 64, 16, 16, 2 + 1
    assert row["flops"] == pytest.approx(3 * (fwd["flops"] + 2.0 * batch * n * d * f * heads))


def test_softmax_flops_formula():
    kern = build_kernel("softmax", LayerShape(8, 8, 64))
    b, h, n, d = 2, 8, 256, 64
    assert estimate_flops(kern, n, batch=b, causal=False) == 4 * b * h * n * n * d
    assert estimate_flops(kern, n, batch=b, causal=True) == pytest.approx(4 * b * h * n * n * d / 2, rel=1 / n)


def _baddbmm_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    batch, rows, inner = a_shape
    return 2 * batch * rows * inner * b_shape[-1]


@pytest.mark.parametrize("name,causal", [("elu", True), ("elu", False), ("taylor", True), ("taylor", False),
                                         ("performer", True), ("hedgehog", False), ("dijiang", False),
                                         ("dijiang", True), ("liger", True), ("liger", False), ("gla", True),
                                         ("cosformer", True)])
def test_linear_flops_match_torch_flop_counter(name, causal):
    """The hand count of the chunked/bidirectional algorithm equals torch's count of its matmuls."""
    kern = build_kernel(name, LayerShape(4, 2, 16, 0, 512))
    gen = torch.Generator().manual_seed(0)
    n = 100  # not a multiple of the chunk size
    q, k, v = (torch.randn(2, h, n, 16, generator=gen) for h in (4, 2, 2))
    # torch's counter knows baddbmm but not its in-place form, which the scan uses for the state
    inplace = {torch.ops.aten.baddbmm_: _baddbmm_flops}
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter, torch.no_grad():
        kern(q, k, v, causal=causal)
    assert estimate_flops(kern, n, batch=2, causal=causal) == counter.get_total_flops()


def test_skyformer_flops_per_form():
    """Nyström: torch's count of its matmuls stays below the hand count (cdist is counted by hand only); the
    exact form (fused SDPA, which torch's CPU counter does not see) is the N² count on D + 1 coordinates."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=gen) for _ in range(3))
    kern = build_kernel("skyformer", LayerShape(4, 4, 16, 0, 512), {"form": "nystrom", "num_landmarks": 8})
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        kern(q, k, v, causal=False)
    assert 0 < counter.get_total_flops() <= estimate_flops(kern, 40, batch=2, causal=False)
    exact = build_kernel("skyformer", LayerShape(4, 4, 16, 0, 512), {"form": "exact"})
    assert estimate_flops(exact, 40, batch=2, causal=False) == 2 * 2 * 4 * 40 * 40 * 2 * 17


def test_machine_peak_and_memory():
    info = machine_info()
    assert info["torch"] == torch.__version__ and info["torch_threads"] >= 1 and info["cpu"]
    assert measure_matmul_peak(torch.float32, 1, size=128, repeats=1) > 0
    mib, method = measure_peak_memory(lambda: torch.ones(8 * 2**20 // 4).add_(1))
    if method in ("vmhwm", "statm_sampled"):
        assert 4 <= mib <= 64  # an 8 MiB tensor


def test_cli_main_writes_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("kernel_bench", CLI_PATH)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "results.json"
    argv = ["--kernels", "cosine", "--lengths", "32", "64", "--causal", "--heads", "2", "--head-dim", "16",
            "--repeats", "1", "--warmup", "0", "--no-peak", "--threads", "1", "--output", str(out),
            "--plot", str(tmp_path / "results.png"), "--param", "cosine.gain=3.0"]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["torch_threads"] == 1
    assert data["settings"]["causal_modes"] == [True]
    assert [(r["kernel"], r["n"], r["causal"]) for r in data["rows"]] == [
        ("softmax", 32, True), ("cosine", 32, True), ("softmax", 64, True), ("cosine", 64, True)]
    text = capsys.readouterr()
    assert "| cosine | causal fwd | 64 |" in text.out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in text.err
    else:
        assert (tmp_path / "results.png").exists()


def test_speed_suite_script_runs_small(tmp_path):
    """benchmarks/speed_suite.sh with QUICK=1 (tiny sizes, no model): every bench part writes its rows."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    root = REPO
    script = root / "benchmarks" / "speed_suite.sh"
    # the script calls `hf-kernel-attn`: put a shim first on PATH that runs this checkout with this interpreter
    # (not whatever installed copy PATH would find) and logs each call
    shim_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    shim_dir.mkdir()
    shim = shim_dir / "hf-kernel-attn"
    shim.write_text(
        "#!/bin/sh\n"
        f"echo \"$1\" >> {shlex.quote(str(log))}\n"
        f"PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}} "
        f"exec {shlex.quote(sys.executable)} -m hf_kernel_attn.cli \"$@\"\n"
    )
    shim.chmod(0o755)
    env = {**os.environ, "QUICK": "1", "THREADS": "1", "PATH": f"{shim_dir}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out"
    subprocess.run(["bash", str(script), str(out)], check=True, env=env, capture_output=True, timeout=300)
    assert log.read_text().split() == ["bench", "bench", "bench"]
    for name, backward in (("forward", False), ("backward", True), ("memory64k", False)):
        rows = json.loads((out / f"{name}.json").read_text())["rows"]
        ok = [r for r in rows if r["status"] == "ok"]
        assert ok and all(r["backward"] is backward for r in ok)
        assert {"elu", "hedgehog", "taylor"} <= {r["kernel"] for r in ok}
