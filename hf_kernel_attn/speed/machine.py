"""What a benchmark ran on, and its roof: CPU model and cores, torch threads (:func:`num_threads`), the accelerator,
and the achievable matmul throughput (:func:`measure_matmul_peak`, 2·n³ FLOPs / the best time of an n × n
matmul); also the dtype names the benchmarks take (:func:`parse_dtype`)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from collections.abc import Iterator
from typing import Any

import torch

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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU."""
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
        synchronize(dev)
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            (a @ b)
            synchronize(dev)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best / 1e9


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
