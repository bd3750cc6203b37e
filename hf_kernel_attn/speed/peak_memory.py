"""Peak memory of one call (:func:`measure_peak_memory`). On CUDA, ``torch.cuda.max_memory_allocated`` during the
call minus what was allocated before it. On CPU, the rise of the process's peak resident set size during the call:
freed heap memory is first returned to the OS (glibc ``malloc_trim``), the kernel's peak-RSS counter ``VmHWM`` is reset
(``echo 5 > /proc/self/clear_refs``) and ``VmHWM - VmRSS(before)`` is read after the call; where that is unavailable,
``/proc/self/statm`` is sampled every 0.5 ms in a background thread instead (short peaks can be missed)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from .machine import synchronize


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
        synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        synchronize(dev)
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
