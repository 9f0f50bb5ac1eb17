"""Measuring helpers shared by the benchmarks: repeat, take the median, report spread; how far
one call raises a process's peak memory (the benchmarks' ``peak_extra_mb``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch


@attrs.frozen
class RunTiming:
    """One timed generation run (``bench model``'s engines): ``seconds`` in all;
    ``first_token_seconds``: from its start until every request had its first token;
    ``decode_tokens``: tokens generated after that moment (the decode phase, timed inside the
    run rather than as the difference of two runs)."""

    seconds: float
    first_token_seconds: float | None = None
    decode_tokens: int | None = None


def _time_one(fn: Callable[[], Any], sync: Callable[[], None] | None) -> float:
    """Seconds of one call of ``fn``, ``sync`` run before each clock read if given."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def time_calls(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1,
               sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times, then time ``repeat`` calls; seconds per call.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read on async devices.
    """
    for _ in range(warmup):
        fn()
    samples = [_time_one(fn, sync) for _ in range(repeat)]
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "repeat": repeat}


def time_interleaved(fns: dict[str, Callable[[], Any]], *, repeat: int, warmup: int = 1,
                     sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, the calls interleaved round by round so drift on
    a shared machine hits them alike; ``warmup`` untimed rounds first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(repeat):
        for key, fn in fns.items():
            samples[key].append(_time_one(fn, sync))
    return samples


#: Appended to a script run in another interpreter: it defines ``LOOPS`` (name -> function of
#: no arguments) and ``INFO`` (a dict), prints ``INFO`` as JSON, then times ``LOOPS[name]``
#: called ``number`` times for each ``"name number"`` line it reads, one float (seconds) a line.
LOOP_SERVER = r'''
import gc as _gc, json as _json, sys as _sys, time as _time
_sys.stdout.write(_json.dumps(INFO) + "\n"); _sys.stdout.flush()
for _line in _sys.stdin:
    _name, _number, _gc_off = _line.split()
    _fn, _n = LOOPS[_name], int(_number)
    if _gc_off == "1":
        _gc.collect(); _gc.disable()
    _start = _time.perf_counter()
    for _ in range(_n):
        _fn()
    _elapsed = _time.perf_counter() - _start
    _gc.enable()
    _sys.stdout.write(repr(_elapsed) + "\n"); _sys.stdout.flush()
'''


class InterpreterLoops:
    """Loops timed on command in another interpreter (vLLM's), so that they interleave with
    ours round by round and drift on a shared machine hits both sides alike.

    ``script`` defines ``LOOPS`` and ``INFO`` (see ``LOOP_SERVER``); ``info`` is its ``INFO``.
    Raises ``RuntimeError`` (with the interpreter's last words) when it does not start."""

    def __init__(self, python: str, script: str, *, env: dict[str, str] | None = None,
                 cwd: str = "/tmp", timeout: float = 600.0) -> None:
        import json
        import subprocess

        self._proc = subprocess.Popen([python, "-c", script + LOOP_SERVER], cwd=cwd, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self._timeout = timeout
        first = self._readline()
        try:
            self.info: dict[str, Any] = json.loads(first)
        except ValueError:
            self.close()
            raise RuntimeError(f"{python} did not start the timing loops: "
                               f"{first.strip() or self._stderr_tail()}") from None

    def _readline(self) -> str:
        if self._proc.stdout is None:  # pragma: no cover - always piped
            return ""
        return self._proc.stdout.readline()

    def _stderr_tail(self) -> str:
        self._proc.kill()
        _, err = self._proc.communicate(timeout=self._timeout)
        return " | ".join((err or "").strip().splitlines()[-3:])

    def seconds(self, name: str, number: int, *, gc_off: bool = False) -> float:
        """Seconds ``LOOPS[name]`` took for ``number`` calls over there."""
        if self._proc.stdin is None:  # pragma: no cover - always piped
            raise RuntimeError("the timing interpreter has no stdin")
        self._proc.stdin.write(f"{name} {int(number)} {int(gc_off)}\n")
        self._proc.stdin.flush()
        line = self._readline()
        try:
            return float(line)
        except ValueError:
            raise RuntimeError(f"the timing interpreter failed on {name!r}: "
                               f"{line.strip() or self._stderr_tail()}") from None

    def close(self) -> None:
        """Stop the other interpreter."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.communicate()

    def __enter__(self) -> InterpreterLoops:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
