"""The machine's load beside a benchmark's figures, in words: ``load 1.93 -> 2.10 / 2 cores
(1-minute average)``, not ``[1.9306640625, 2.10302734375]``. A load near the core count means
other work shared the CPUs with the timings."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["load_text", "machine_cores", "one_minute_load"]


def one_minute_load() -> float | None:
    """The 1-minute load average, rounded to 2 digits; None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_cores() -> int | None:
    """The machine's cores: what its load average (runnable threads, machine-wide) is set
    against."""
    return os.cpu_count()


def _first(value: float | Sequence[float] | None) -> float | None:
    """A load reading: a number, or ``os.getloadavg()``'s list (its 1-minute value)."""
    if isinstance(value, Sequence):
        return float(value[0]) if value else None
    return None if value is None else float(value)


def load_text(before: float | Sequence[float] | None, after: float | Sequence[float] | None,
              cores: int | None = None) -> str:
    """``load 1.93 -> 2.10 / 2 cores (1-minute average)`` from the readings before and after
    a benchmark (numbers, or ``getloadavg`` lists); ``cores`` defaults to ``machine_cores``."""
    first, last = _first(before), _first(after)
    if first is None and last is None:
        return "load n/a"
    cores = machine_cores() if cores is None else cores
    readings = " -> ".join(f"{x:.2f}" for x in (first, last) if x is not None)
    return f"load {readings}" + (f" / {cores} cores" if cores else "") + " (1-minute average)"
