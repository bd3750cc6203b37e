"""Speed and memory benchmarks of the attention kernels against SDPA (the ``softmax`` kernel).

    from hf_kernel_attn.speed.kernel_bench import SuiteSettings, format_table, machine_info, run_suite
    rows = run_suite(["gaussian", "elu"], [1024, 2048], SuiteSettings(causal_modes=(True,)))
    print(machine_info()); print(format_table(rows))

The run settings are frozen dataclasses (:class:`BenchSettings` for one kernel, :class:`SuiteSettings` for a suite);
the machine, peak-memory and FLOP parts live in :mod:`.machine`, :mod:`.peak_memory` and :mod:`.flops`.

What is measured, per (kernel, length, causal, backward):

* **time**: the median of ``repeats`` wall-clock timings of one kernel call (forward under
  ``torch.no_grad``, or forward + backward of ``out`` against a fixed random gradient), after ``warmup``
  untimed calls; CUDA is synchronised around each timing.
* **peak memory**: on CUDA, ``torch.cuda.max_memory_allocated`` during one untimed call minus what was
  allocated before it. On CPU, the rise of the process's peak resident set size during one untimed call:
  freed heap memory is first returned to the OS (glibc ``malloc_trim``), the kernel's peak-RSS counter
  ``VmHWM`` is reset (``echo 5 > /proc/self/clear_refs``) and ``VmHWM - VmRSS(before)`` is read after the
  call, so no short-lived peak is missed (:mod:`.peak_memory`). Where that is unavailable, ``/proc/self/statm``
  is sampled every 0.5 ms in a background thread instead (short peaks can be missed). Either way the inputs are
  allocated before the baseline: the figure is the kernel's workspace + output (+ gradients).
  It is a process-level figure, so allocations by other threads of the same process add noise.
* **FLOPs**: an estimate of the matrix-multiply work of the algorithm the kernel actually runs (see
  :func:`estimate_flops`, :mod:`.flops`); elementwise work (exp, softmax, feature products) is not counted. Backward
  is counted as twice the forward (fwd + bwd = 3x fwd), the usual convention, without recomputation.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..kernels import KERNELS, SOFTMAX, LayerShape, build_kernel, kernel_class
from .flops import BACKWARD_FLOP_FACTOR, estimate_flops, feature_dim, gate_dim
from .machine import (
    cpu_model,
    format_machine,
    machine_info,
    measure_matmul_peak,
    num_threads,
    parse_dtype,
    synchronize,
)
from .peak_memory import measure_peak_memory

BASELINE = SOFTMAX
MAX_LEN_QUADRATIC = 32768
MAX_LEN_LINEAR = 65536
ROW_KEYS = (
    "kernel", "kind", "n", "causal", "backward", "batch", "heads", "kv_heads", "head_dim", "dtype", "device",
    "threads", "status", "reason", "time_s", "time_ms", "times_s", "peak_mem_mib", "mem_method", "flops",
    "gflops", "ratio_vs_sdpa",
)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """How one kernel is timed: random q ``[batch, heads, n, head_dim]`` and K/V with ``kv_heads`` heads (None: as
    many as ``heads``) in ``dtype`` on ``device`` with ``threads`` CPU threads (None: torch's current count); the
    median of ``repeats`` timings after ``warmup`` untimed calls; the peak memory of one call if ``measure_memory``;
    ``seed`` draws the inputs."""

    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 64
    dtype: str | torch.dtype = torch.float32
    repeats: int = 3
    warmup: int = 1
    device: str = "cpu"
    threads: int | None = None
    measure_memory: bool = True
    seed: int = 0

    @property
    def num_kv_heads(self) -> int:
        """The K/V heads: ``kv_heads``, or ``heads`` when it is None (MHA)."""
        return self.kv_heads or self.heads


@dataclasses.dataclass(frozen=True)
class SuiteSettings(BenchSettings):
    """A suite run (:func:`run_suite`): the :class:`BenchSettings` of every kernel, each in ``causal_modes``, the
    forward alone or forward + backward (``backward``); ``params`` maps a kernel name to its options; kernels longer
    than their limit (``max_len_quadratic`` for softmax-like kernels, ``max_len_linear`` otherwise) are skipped."""

    causal_modes: Sequence[bool] = (True, False)
    backward: bool = False
    params: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    max_len_quadratic: int = MAX_LEN_QUADRATIC
    max_len_linear: int = MAX_LEN_LINEAR


def kernel_kind(name: str) -> str:
    """The kernel class's ``kind``: ``"softmax-like"`` (quadratic in N), ``"linear"`` (feature maps), ``"gated"``,
    ``"delta"`` (the delta rule: deltanet, gated_deltanet; their own ``flops``) or ``"nystrom"`` (skyformer)."""
    return kernel_class(name).kind


# ------------------------------------------------------------------------------------------------ timing


def _row_template(name: str, n: int, causal: bool, backward: bool, settings: BenchSettings,
                  threads: int) -> dict[str, Any]:
    """A row of ``ROW_KEYS`` for kernel ``name`` at length ``n`` in one mode, its measurements still None."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(kernel=name, kind=kernel_kind(name), n=n, causal=causal, backward=backward, batch=settings.batch,
               heads=settings.heads, kv_heads=settings.num_kv_heads, head_dim=settings.head_dim,
               dtype=str(parse_dtype(settings.dtype)).removeprefix("torch."), device=str(settings.device),
               threads=threads, status="ok", reason="")
    return row


def bench_kernel(
    name: str,
    n: int,
    *,
    causal: bool,
    backward: bool,
    settings: BenchSettings = BenchSettings(),  # noqa: B008 - frozen: one shared default is safe
    params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Time one kernel (options ``params``) on random q/k/v of ``settings``; returns a row with the keys in
    ``ROW_KEYS`` (``time_s`` = median seconds, ``peak_mem_mib``, ``flops``, ``gflops``; ``ratio_vs_sdpa``
    is filled in by :func:`run_suite`). Raises ValueError for an unknown kernel or unsupported mode."""
    s = settings
    dtype = parse_dtype(s.dtype)
    batch, heads, kv_heads, head_dim = s.batch, s.heads, s.num_kv_heads, s.head_dim
    cls = kernel_class(name)
    if causal and not cls.supports_causal:
        raise ValueError(f"kernel {name!r} is bidirectional only")
    if not causal and not cls.supports_bidirectional:
        raise ValueError(f"kernel {name!r} is causal only")
    dev = torch.device(s.device)
    with num_threads(s.threads if dev.type == "cpu" else None) as used_threads:
        row = _row_template(name, n, causal, backward, s, used_threads)
        shape = LayerShape(heads, kv_heads, head_dim, layer_idx=0, max_positions=max(n, 2048))
        kern = build_kernel(name, shape, None if params is None else dict(params)).to(dev)
        gen = torch.Generator().manual_seed(s.seed)
        q = torch.randn(batch, heads, n, head_dim, generator=gen).to(dev, dtype)
        k = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(dev, dtype)
        v = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(dev, dtype)
        scaling = head_dim**-0.5
        if backward:
            for t in (q, k, v):
                t.requires_grad_(True)
            grad_out = torch.randn(batch, n, heads, head_dim, generator=gen).to(dev, dtype)

            def call() -> None:
                for t in (q, k, v):
                    t.grad = None
                kern.zero_grad(set_to_none=True)
                kern(q, k, v, causal=causal, scaling=scaling).backward(grad_out)
        else:

            def call() -> None:
                with torch.no_grad():
                    kern(q, k, v, causal=causal, scaling=scaling)

        untimed = max(0, s.warmup)
        if s.measure_memory:
            # the first untimed call doubles as the memory measurement (an extra call when warmup = 0)
            row["peak_mem_mib"], row["mem_method"] = measure_peak_memory(call, dev)
            untimed -= 1
        for _ in range(untimed):
            call()
        synchronize(dev)
        times = []
        for _ in range(max(1, s.repeats)):
            t0 = time.perf_counter()
            call()
            synchronize(dev)
            times.append(time.perf_counter() - t0)
        row["times_s"] = times
        row["time_s"] = statistics.median(times)
        row["time_ms"] = row["time_s"] * 1e3
        row["flops"] = estimate_flops(kern, n, batch=batch, causal=causal, backward=backward)
        row["gflops"] = row["flops"] / row["time_s"] / 1e9
    return row


def _skip_reason(name: str, n: int, causal: bool, settings: SuiteSettings) -> str | None:
    cls = KERNELS[name]
    if causal and not cls.supports_causal:
        return "bidirectional only"
    if not causal and not cls.supports_bidirectional:
        return "causal only"
    limit = settings.max_len_quadratic if kernel_kind(name) == "softmax-like" else settings.max_len_linear
    if n > limit:
        return f"n={n} above the {kernel_kind(name)} length limit {limit}"
    return None


def run_suite(
    kernels: Sequence[str],
    lengths: Sequence[int],
    settings: SuiteSettings = SuiteSettings(),  # noqa: B008 - frozen: one shared default is safe
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark ``kernels`` at every length and causal mode of ``settings``, always including SDPA (``softmax``) at
    the same sizes in the same run; each row gets ``ratio_vs_sdpa`` = its time / softmax's time (None when
    softmax was skipped or failed). Kernels that cannot run a mode or exceed the length limit
    (``settings.max_len_quadratic`` for softmax-like ones, ``settings.max_len_linear`` otherwise) are recorded as
    ``status="skipped"`` with a ``reason``; a RuntimeError (e.g. out of memory) as ``status="error"``.
    ``progress`` is called with each finished row."""
    names = list(dict.fromkeys(kernels))
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; available kernels: {sorted(KERNELS)}")
    names = [BASELINE] + [k for k in names if k != BASELINE]
    backward = settings.backward
    rows: list[dict[str, Any]] = []
    with num_threads(settings.threads if torch.device(settings.device).type == "cpu" else None) as used_threads:
        for causal in settings.causal_modes:
            for n in lengths:
                baseline_time = None
                for name in names:
                    reason = _skip_reason(name, n, causal, settings)
                    if reason is not None:
                        row = _row_template(name, n, causal, backward, settings, used_threads)
                        row.update(status="skipped", reason=reason)
                    else:
                        try:
                            row = bench_kernel(name, n, causal=causal, backward=backward, settings=settings,
                                               params=settings.params.get(name))
                        except RuntimeError as err:  # includes torch.OutOfMemoryError
                            row = _row_template(name, n, causal, backward, settings, used_threads)
                            row.update(status="error", reason=f"{type(err).__name__}: {err}".splitlines()[0])
                    if name == BASELINE and row["status"] == "ok":
                        baseline_time = row["time_s"]
                    if row["status"] == "ok" and baseline_time:
                        row["ratio_vs_sdpa"] = row["time_s"] / baseline_time
                    rows.append(row)
                    if progress is not None:
                        progress(row)
    return rows


# ------------------------------------------------------------------------------------------------ report


def format_table(rows: Sequence[dict[str, Any]], peak_gflops: float | None = None) -> str:
    """A markdown table of the rows (time ms, ratio vs SDPA, peak MiB, GFLOP/s[, % of matmul peak])."""
    header = ["kernel", "mode", "N", "time ms", "x SDPA", "peak MiB", "GFLOP/s"]
    if peak_gflops:
        header.append("% peak")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        mode = ("causal" if r["causal"] else "bidir") + (" fwd+bwd" if r["backward"] else " fwd")
        if r["status"] != "ok":
            cells = [r["kernel"], mode, str(r["n"]), f"{r['status']}: {r['reason']}"] + [""] * (len(header) - 4)
        else:
            ratio = "" if r["ratio_vs_sdpa"] is None else f"{r['ratio_vs_sdpa']:.2f}"
            mem = "" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.1f}"
            cells = [r["kernel"], mode, str(r["n"]), f"{r['time_ms']:.2f}", ratio, mem, f"{r['gflops']:.1f}"]
            if peak_gflops:
                cells.append(f"{100 * r['gflops'] / peak_gflops:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "BACKWARD_FLOP_FACTOR", "BASELINE", "MAX_LEN_LINEAR", "MAX_LEN_QUADRATIC", "ROW_KEYS", "BenchSettings",
    "SuiteSettings", "bench_kernel", "cpu_model", "estimate_flops", "feature_dim", "format_machine", "format_table",
    "gate_dim", "kernel_kind", "machine_info", "measure_matmul_peak", "measure_peak_memory", "num_threads",
    "parse_dtype", "run_suite",
]
