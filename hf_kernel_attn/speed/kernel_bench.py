"""Speed and memory benchmarks of the attention kernels against SDPA (the ``softmax`` kernel).

    from hf_kernel_attn.speed.kernel_bench import run_suite, machine_info, format_table
    rows = run_suite(["gaussian", "elu"], [1024, 2048], causal_modes=(True,))
    print(machine_info()); print(format_table(rows))

What is measured, per (kernel, length, causal, backward):

* **time**: the median of ``repeats`` wall-clock timings of one kernel call (forward under
  ``torch.no_grad``, or forward + backward of ``out`` against a fixed random gradient), after ``warmup``
  untimed calls; CUDA is synchronised around each timing.
* **peak memory**: on CUDA, ``torch.cuda.max_memory_allocated`` during one untimed call minus what was
  allocated before it. On CPU, the rise of the process's peak resident set size during one untimed call:
  freed heap memory is first returned to the OS (glibc ``malloc_trim``), the kernel's peak-RSS counter
  ``VmHWM`` is reset (``echo 5 > /proc/self/clear_refs``) and ``VmHWM - VmRSS(before)`` is read after the
  call, so no short-lived peak is missed. Where that is unavailable, ``/proc/self/statm`` is sampled
  every 0.5 ms in a background thread instead (short peaks can be missed). Either way the inputs are
  allocated before the baseline: the figure is the kernel's workspace + output (+ gradients).
  It is a process-level figure, so allocations by other threads of the same process add noise.
* **FLOPs**: an estimate of the matrix-multiply work of the algorithm the kernel actually runs (see
  :func:`estimate_flops`); elementwise work (exp, softmax, feature products) is not counted. Backward
  is counted as twice the forward (fwd + bwd = 3x fwd), the usual convention, without recomputation.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..kernels import KERNELS, SOFTMAX, Kernel, LayerShape, build_kernel, kernel_class
from ..kernels.linear.cost import quadratic_block

BASELINE = SOFTMAX
MAX_LEN_QUADRATIC = 32768
MAX_LEN_LINEAR = 65536
BACKWARD_FLOP_FACTOR = 3.0  # forward + backward = 3 x forward matmul FLOPs
ROW_KEYS = (
    "kernel", "kind", "n", "causal", "backward", "batch", "heads", "kv_heads", "head_dim", "dtype", "device",
    "threads", "status", "reason", "time_s", "time_ms", "times_s", "peak_mem_mib", "mem_method", "flops",
    "gflops", "ratio_vs_sdpa",
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"fp32"`` / ``torch.float32`` -> ``torch.float32`` (also fp16 and bf16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
    name = aliases.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def kernel_kind(name: str) -> str:
    """The kernel class's ``kind``: ``"softmax-like"`` (quadratic in N), ``"linear"`` (feature maps), ``"gated"``,
    ``"delta"`` (the delta rule: deltanet, gated_deltanet; their own ``flops``) or ``"nystrom"`` (skyformer)."""
    return kernel_class(name).kind


# ---------------------------------------------------------------------------------------------- machine


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[int]:
    """Temporarily set ``torch.set_num_threads``; yields the thread count in effect."""
    old = torch.get_num_threads()
    if threads is not None and threads != old:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (falls back to ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, torch version and threads, accelerator, and the
    1-minute load average (a load above the usable cores means the timings were contended)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "loadavg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    dtype: str | torch.dtype = torch.float32,
    threads: int | None = None,
    *,
    size: int | None = None,
    repeats: int = 3,
    device: str = "cpu",
) -> float:
    """Achievable matmul throughput in GFLOP/s: the best of ``repeats`` timings of a ``size``² matmul
    (default 2048 on CPU, 8192 on CUDA), the roof to read kernels' GFLOP/s against."""
    dev = torch.device(device)
    dtype = parse_dtype(dtype)
    size = size or (8192 if dev.type == "cuda" else 2048)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dev, dtype)
    b = torch.randn(size, size, generator=gen).to(dev, dtype)
    best = math.inf
    with num_threads(threads), torch.no_grad():
        (a @ b)  # warm up (thread pool, cuBLAS handles)
        _sync(dev)
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            (a @ b)
            _sync(dev)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best / 1e9


# ------------------------------------------------------------------------------------------------ memory


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_LIBC: Any = None


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS so that reused memory shows up in the RSS again (glibc)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - raises AttributeError off glibc
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _StatmSampler:
    """Background thread recording the largest RSS seen in ``/proc/self/statm`` (fallback method)."""

    def __init__(self, interval: float = 5e-4) -> None:
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> _StatmSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def measure_peak_memory(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[float | None, str]:
    """Run ``fn`` once; return (peak extra memory in MiB, method) as described in the module docstring."""
    dev = torch.device(device)
    mib = 2.0**20
    if dev.type == "cuda":
        _sync(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        _sync(dev)
        return (torch.cuda.max_memory_allocated(dev) - before) / mib, "cuda_max_memory_allocated"
    if not os.path.exists("/proc/self/status"):
        fn()
        return None, "unavailable"
    _malloc_trim()
    if _reset_hwm():
        before = _status_kib("VmRSS")
        fn()
        peak = _status_kib("VmHWM")
        if before is not None and peak is not None:
            return max(0, peak - before) / 1024.0, "vmhwm"
        return None, "unavailable"
    with _StatmSampler() as sampler:
        before = sampler.peak
        fn()
    return max(0, sampler.peak - before) / mib, "statm_sampled"


# ------------------------------------------------------------------------------------------------- FLOPs


def feature_dim(kernel: Kernel) -> int:
    """F, the feature dimension of a linear kernel (measured by mapping one token)."""
    s = kernel.shape
    q = torch.zeros(1, s.num_heads, 1, s.head_dim)
    k = torch.zeros(1, s.num_kv_heads, 1, s.head_dim)
    device = next((t.device for t in kernel.state_dict().values()), torch.device("cpu"))
    with torch.no_grad():
        _, fk = kernel.features(q.to(device), k.to(device), s.head_dim**-0.5)
    return int(fk.shape[-1])


def _chunked_causal_flops(n: int, c: int, f: int, dv: int, hq: int, hkv: int, score_dim: int | None = None) -> float:
    """Matmul FLOPs of :func:`..kernels.linear.scan` for one sequence. Values carry an extra all-ones column (the
    denominator), so they are Dv + 1 wide. Per query head: the in-chunk scores (2·L²·F) and
    scores @ V (2·L²·(Dv + 1)) per chunk of length L, and φ(q) @ S (2·N·F·(Dv + 1)); per KV head the state
    updates φ(k)ᵀ @ V (2·N·F·(Dv + 1)). A kernel with a closed form (taylor) scores in-chunk pairs on
    ``score_dim`` = D coordinates instead of F."""
    full, rest = divmod(n, c)
    sum_sq = full * c * c + rest * rest
    per_q = 2.0 * sum_sq * ((score_dim or f) + dv + 1) + 2.0 * n * f * (dv + 1)
    per_kv = 2.0 * n * f * (dv + 1)
    return hq * per_q + hkv * per_kv


def gate_dim(kernel: Kernel) -> int:
    """Γ, the number of gates per token of a kernel with a decay (1 for a fixed decay), measured on one key."""
    s = kernel.shape
    device = next((t.device for t in kernel.state_dict().values()), torch.device("cpu"))
    k = torch.zeros(1, s.num_kv_heads, 1, s.head_dim, device=device)
    with torch.no_grad():
        return int(kernel.gates(k, s.head_dim**-0.5).shape[-1])


def _gated_scan_flops(lengths: Sequence[int], chunk: int, f: int, dv: int, hq: int, hkv: int, gates: int) -> float:
    """Matmul FLOPs of the gated scan (:func:`..kernels.linear.gated.gated_causal`), one call per entry of
    ``lengths``: chunks of C = min(chunk, L) positions (the last one padded), and per chunk and KV head with G query
    heads the in-chunk sums of the gates (2·C²·Γ), φ(q) S (2·G·C·F·E), the in-chunk scores (2·G·C²·F) times the
    values (2·G·C²·E) and the state update φ(k)ᵀ V (2·F·C·E), E = Dv + 1."""
    e, g = dv + 1, hq // hkv
    total = 0.0
    for length in lengths:
        if length == 0:
            continue
        c = min(chunk, length)
        per_chunk = 2.0 * c * c * gates + 2.0 * g * c * f * e + 2.0 * g * c * c * (f + e) + 2.0 * f * c * e
        total += hkv * -(-length // c) * per_chunk
    return total


def _quadratic_causal_flops(n: int, batch: int, hq: int, d: int, dv: int) -> float:
    """Matmul FLOPs of the closed-form causal quadratic path (taylor, short sequences): each block of L
    queries scores the keys up to its end E (2·L·E·d) and multiplies by V with its ones column
    (2·L·E·(Dv + 1)), per query head."""
    block = quadratic_block(n, batch * hq * n)
    pairs = sum((min(s + block, n) - s) * min(s + block, n) for s in range(0, n, block))
    return hq * 2.0 * pairs * (d + dv + 1)


def estimate_flops(kernel: Kernel, n: int, *, batch: int = 1, causal: bool, backward: bool = False) -> float:
    """Estimated matmul FLOPs of one call on ``batch`` sequences of ``n`` tokens (self-attention).

    * softmax-like: 2·B·H·P·(Dqk + Dv), P = N² pairs (N(N+1)/2 causal) — i.e. 4·B·H·N²·D, halved for causal
      (gaussian's q·k runs on D + 1 coordinates);
    * linear, causal: the chunked algorithm's matmuls with F features (:func:`_chunked_causal_flops`);
    * linear, bidirectional: 2·B·(Hkv + Hq)·N·F·(Dv + 1), i.e. ≈ 4·B·H·N·F·D (two causal scans
      instead when the kernel has a decay, fixed as DiJiang's or gated); at short N without autograd the
      closed form's score matrix, 2·B·Hq·N²·(D + Dv + 1) (taylor);
    * linear kernels add their feature projection (performer ω, hedgehog W, DiJiang DCT): 2·N·D·P per head
      for q and k;
    * skyformer: landmark Gram matrices, Newton–Schulz iterations and the right-to-left products; where it
      runs the exact Gaussian (``form``), the fused attention on D + 1 coordinates.
    """
    own = kernel.flops(n, batch=batch, causal=causal, backward=backward)
    if own is not None:
        return float(own)
    s = kernel.shape
    hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
    dv = d
    kind = kernel.kind
    if kind == "softmax-like":
        pairs = n * (n + 1) / 2 if causal else float(n * n)
        dqk = kernel.score_dim(d)
        fwd = 2.0 * batch * hq * pairs * (dqk + dv)
    elif kind in ("linear", "gated"):
        f = feature_dim(kernel)
        chunk = kernel.options.chunk_size
        closed = kernel.has_closed_form and not backward  # the no-grad path scores from q·k
        meta = [torch.empty(batch, h, n, d, device="meta") for h in (hq, hkv, hkv)]
        if causal and closed and kernel.quadratic_is_cheaper(*meta, False):
            per_seq = _quadratic_causal_flops(n, batch, hq, d, dv)
        elif causal and kernel.is_gated and not getattr(kernel.options, "window", 0):
            # without autograd a block of whole chunks at a time, with it one call
            block = n if backward else kernel.block_length(batch * hq)
            lengths = [min(block, n - start) for start in range(0, n, block)]
            per_seq = _gated_scan_flops(lengths, chunk, f, dv, hq, hkv, gate_dim(kernel))
        elif causal:
            per_seq = _chunked_causal_flops(n, chunk, f, dv, hq, hkv, d if closed else None)
        elif closed and kernel.quadratic_is_cheaper(*meta, False, causal=False):
            per_seq = hq * 2.0 * n * n * (d + dv + 1)  # closed-form scores on D coordinates, then V
        elif kernel.is_gated:  # two gated scans, forwards and backwards
            per_seq = 2 * _gated_scan_flops([n], chunk, f, dv, hq, hkv, gate_dim(kernel))
        else:
            per_seq = 2.0 * (hkv + hq) * n * f * (dv + 1)  # values with their ones column
        per_seq += 2.0 * n * d * kernel.projection_width(backward) * (hq + hkv)
        per_seq += kernel.gate_flops(n)
        fwd = batch * per_seq
    elif not backward and kernel.uses_exact(n, d, dv):  # skyformer's exact Gaussian: fused SDPA, D + 1 wide
        fwd = 2.0 * batch * hq * n * n * (2 * (d + 1))
    else:  # skyformer's Nyström (bidirectional only), after repeating K/V to the query heads
        opts = kernel.options
        lm = 2 * min(opts.num_landmarks // 2, n)
        per_head = (
            2 * 2.0 * n * lm * d  # κ(Q, L) and κ(L, K)
            + 2.0 * lm * lm * d  # κ(L, L)
            + opts.newton_iters * 4 * 2.0 * lm**3  # Newton–Schulz
            + 2.0 * lm * n * dv + 2.0 * lm * lm * dv + 2.0 * n * lm * dv  # left @ (W @ (right @ V))
        )
        if opts.normalize:
            per_head += 2.0 * lm * lm + 2.0 * n * lm
        fwd = batch * hq * per_head
    return fwd * (BACKWARD_FLOP_FACTOR if backward else 1.0)


# ------------------------------------------------------------------------------------------------ timing


def _row_template(name: str, n: int, causal: bool, backward: bool, batch: int, heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: str, threads: int) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(kernel=name, kind=kernel_kind(name), n=n, causal=causal, backward=backward, batch=batch,
               heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
               device=str(device), threads=threads, status="ok", reason="")
    return row


def bench_kernel(
    name: str,
    n: int,
    *,
    causal: bool,
    backward: bool,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    dtype: str | torch.dtype = torch.float32,
    repeats: int = 3,
    warmup: int = 1,
    kv_heads: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    params: dict[str, Any] | None = None,
    measure_memory: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Time one kernel on random ``[batch, heads, n, head_dim]`` q/k/v; returns a row with the keys in
    ``ROW_KEYS`` (``time_s`` = median seconds, ``peak_mem_mib``, ``flops``, ``gflops``; ``ratio_vs_sdpa``
    is filled in by :func:`run_suite`). Raises ValueError for an unknown kernel or unsupported mode."""
    dtype = parse_dtype(dtype)
    kv_heads = kv_heads or heads
    cls = kernel_class(name)
    if causal and not cls.supports_causal:
        raise ValueError(f"kernel {name!r} is bidirectional only")
    if not causal and not cls.supports_bidirectional:
        raise ValueError(f"kernel {name!r} is causal only")
    dev = torch.device(device)
    with num_threads(threads if dev.type == "cpu" else None) as used_threads:
        row = _row_template(name, n, causal, backward, batch, heads, kv_heads, head_dim, dtype, device,
                            used_threads)
        shape = LayerShape(heads, kv_heads, head_dim, layer_idx=0, max_positions=max(n, 2048))
        kern = build_kernel(name, shape, params).to(dev)
        gen = torch.Generator().manual_seed(seed)
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

        untimed = max(0, warmup)
        if measure_memory:
            # the first untimed call doubles as the memory measurement (an extra call when warmup = 0)
            row["peak_mem_mib"], row["mem_method"] = measure_peak_memory(call, dev)
            untimed -= 1
        for _ in range(untimed):
            call()
        _sync(dev)
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            call()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        row["times_s"] = times
        row["time_s"] = statistics.median(times)
        row["time_ms"] = row["time_s"] * 1e3
        row["flops"] = estimate_flops(kern, n, batch=batch, causal=causal, backward=backward)
        row["gflops"] = row["flops"] / row["time_s"] / 1e9
    return row


def _skip_reason(name: str, n: int, causal: bool, max_len_quadratic: int, max_len_linear: int) -> str | None:
    cls = KERNELS[name]
    if causal and not cls.supports_causal:
        return "bidirectional only"
    if not causal and not cls.supports_bidirectional:
        return "causal only"
    limit = max_len_quadratic if kernel_kind(name) == "softmax-like" else max_len_linear
    if n > limit:
        return f"n={n} above the {kernel_kind(name)} length limit {limit}"
    return None


def run_suite(
    kernels: Sequence[str],
    lengths: Sequence[int],
    *,
    causal_modes: Sequence[bool] = (True, False),
    backward: bool = False,
    batch: int = 1,
    heads: int = 8,
    kv_heads: int | None = None,
    head_dim: int = 64,
    dtype: str | torch.dtype = torch.float32,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    threads: int | None = None,
    params: dict[str, dict[str, Any]] | None = None,
    max_len_quadratic: int = MAX_LEN_QUADRATIC,
    max_len_linear: int = MAX_LEN_LINEAR,
    measure_memory: bool = True,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark ``kernels`` at every length and causal mode, always including SDPA (``softmax``) at the
    same sizes in the same run; each row gets ``ratio_vs_sdpa`` = its time / softmax's time (None when
    softmax was skipped or failed). Kernels that cannot run a mode or exceed the length limit
    (``max_len_quadratic`` for softmax-like ones, ``max_len_linear`` otherwise) are recorded as
    ``status="skipped"`` with a ``reason``; a RuntimeError (e.g. out of memory) as ``status="error"``.
    ``params`` maps kernel name -> kernel options. ``progress`` is called with each finished row."""
    names = list(dict.fromkeys(kernels))
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; available kernels: {sorted(KERNELS)}")
    names = [BASELINE] + [k for k in names if k != BASELINE]
    dtype = parse_dtype(dtype)
    params = params or {}
    rows: list[dict[str, Any]] = []
    with num_threads(threads if torch.device(device).type == "cpu" else None) as used_threads:
        for causal in causal_modes:
            for n in lengths:
                baseline_time = None
                for name in names:
                    common = dict(batch=batch, heads=heads, kv_heads=kv_heads or heads, head_dim=head_dim,
                                  dtype=dtype, device=device, threads=used_threads)
                    reason = _skip_reason(name, n, causal, max_len_quadratic, max_len_linear)
                    if reason is not None:
                        row = _row_template(name, n, causal, backward, **common)
                        row.update(status="skipped", reason=reason)
                    else:
                        try:
                            row = bench_kernel(name, n, causal=causal, backward=backward, batch=batch, heads=heads,
                                               head_dim=head_dim, dtype=dtype, repeats=repeats, warmup=warmup,
                                               kv_heads=kv_heads, device=device, params=params.get(name),
                                               measure_memory=measure_memory)
                        except RuntimeError as err:  # includes torch.OutOfMemoryError
                            row = _row_template(name, n, causal, backward, **common)
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


def format_machine(info: dict[str, Any], peak_gflops: float | None = None) -> str:
    """One line describing the machine (for tables and logs)."""
    text = (f"{info['cpu']}, {info['usable_cores']} usable / {info['logical_cores']} logical cores, "
            f"torch {info['torch']}, {info['torch_threads']} threads, device {info['device']}")
    if info.get("gpu"):
        text += f" ({info['gpu']})"
    if peak_gflops:
        text += f", matmul peak {peak_gflops:.0f} GFLOP/s"
    if info.get("loadavg_1min") is not None:
        text += f", load average {info['loadavg_1min']:.2f} at start"
    return text


__all__ = [
    "BASELINE", "MAX_LEN_LINEAR", "MAX_LEN_QUADRATIC", "ROW_KEYS", "bench_kernel", "estimate_flops", "feature_dim",
    "format_machine", "format_table", "kernel_kind", "machine_info", "measure_matmul_peak", "measure_peak_memory",
    "parse_dtype", "run_suite",
]
