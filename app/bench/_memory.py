"""How far one call raises a process's peak memory (the benchmarks' ``peak_extra_mb``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["peak_extra_bytes"]

_libc: Any = None


def _malloc_trim() -> None:
    global _libc
    with contextlib.suppress(OSError, AttributeError):
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"))
        _libc.malloc_trim(0)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """How far one call of ``fn`` raises the peak memory above what was in use before it:
    CUDA ``max_memory_allocated``; on the CPU, the peak RSS (``VmHWM``, reset first through
    ``/proc/self/clear_refs`` after ``malloc_trim``); None where that cannot be read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    _malloc_trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    if rss is None or peak is None:
        return None
    return max(0, peak - rss) * 1024
