"""Timing helpers shared by the benchmarks: repeat, take the median, report spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


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


def time_loop(fn: Callable[[], Any], *, number: int, repeat: int = 5) -> dict[str, float]:
    """Seconds per call of a cheap ``fn``, timed over ``number`` calls, ``repeat`` times."""
    per_call = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        per_call.append((time.perf_counter() - start) / number)
    return {"median_s": statistics.median(per_call), "min_s": min(per_call),
            "max_s": max(per_call), "number": number, "repeat": repeat}


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
