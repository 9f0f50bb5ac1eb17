"""Which kernel TORCH_SDPA runs bf16 prefill on, on a CPU: ours or aten's (oneDNN), chosen by
measured speed where it can go either way.

Two candidates compute bf16 prefill with the LSE and context chunks:

- ``native``: this package's kernel (``cpu/csrc/mla_prefill_cpu.c``; its bf16-products
  build, ``vdpbf16ps``, on AVX512-BF16 CPUs, else its float32 math);
- ``aten``: aten's CPU flash-attention kernel in bf16 (``app.backends.prefill._aten_cpu``),
  whose blocks are oneDNN brgemm calls: on a CPU with AMX tiles oneDNN runs them on AMX.

The rule (``APP_CPU_PREFILL_PATH``):

- ``auto`` (default): on a CPU with AMX tiles, time both on one calibration call (1 request x
  1024 new tokens, causal, 16 heads, DeepSeek's 192/128 head dims, with the LSE; best of 3
  each, interleaved, after a warm-up) once per process, and take the faster; elsewhere
  ``native`` without measuring (measured on AVX512-BF16 EPYCs: ~2x aten's bf16 kernel,
  docs/benchmarks.md). A path that cannot run here is not a candidate.
- ``measure``: the measurement on any CPU; ``native`` / ``aten``: that path, unmeasured.

:func:`bf16_prefill_path` gives the choice and why (``python -m app platform``, the selector's
``kernel_path``). The measuring is passed in (``timer(path) -> seconds``): TORCH_SDPA supplies
it, so this module imports no backend; tests give their own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import attrs

__all__ = ["ATEN", "NATIVE", "PATH_ENV", "PATH_VALUES", "Bf16PrefillPath", "bf16_prefill_path",
           "choose_bf16_prefill_path", "read_path_setting", "reset_bf16_prefill_path"]

#: The two candidates.
NATIVE = "native"
ATEN = "aten"
#: The setting, and its values.
PATH_ENV = "APP_CPU_PREFILL_PATH"
PATH_VALUES = ("auto", "measure", NATIVE, ATEN)
#: Timed calls per path (the best is kept), after one untimed call of each.
ROUNDS = 3

#: ``timer(path) -> seconds`` of one calibration call on ``path``.
Timer = Callable[[str], float]


@attrs.frozen
class Bf16PrefillPath:
    """The path bf16 prefill takes (``"native"`` or ``"aten"``), ``reason`` (the rule and,
    when measured, the timings), ``seconds`` (best calibration call per path measured)."""

    path: str
    reason: str
    seconds: dict[str, float] = attrs.field(factory=dict)


def read_path_setting() -> str:
    """``APP_CPU_PREFILL_PATH`` (default ``auto``); ``ValueError`` naming the values
    allowed for anything else."""
    raw = os.environ.get(PATH_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in PATH_VALUES:
        raise ValueError(f"{PATH_ENV}: expected one of {', '.join(PATH_VALUES)} (or unset), "
                         f"got {raw!r}")
    return value


def choose_bf16_prefill_path(setting: str, amx_cpu: bool, runnable: dict[str, str | None],
                             timer: Timer, rounds: int = ROUNDS) -> Bf16PrefillPath:
    """The rule of the module docstring. ``runnable``: each path -> None when it can run
    here, else why not; ``timer`` is called only when the rule measures."""
    usable = [p for p in (NATIVE, ATEN) if runnable.get(p) is None]
    if not usable:
        why = "; ".join(f"{p}: {runnable.get(p)}" for p in (NATIVE, ATEN))
        return Bf16PrefillPath(ATEN, f"neither path can run ({why}); aten's kernel")
    if setting in (NATIVE, ATEN):
        if setting in usable:
            return Bf16PrefillPath(setting, f"{PATH_ENV}={setting}")
        other = usable[0]
        return Bf16PrefillPath(other, f"{PATH_ENV}={setting}, but it cannot run here "
                                      f"({runnable[setting]}): {other}")
    if len(usable) == 1:
        only = usable[0]
        other = ATEN if only == NATIVE else NATIVE
        return Bf16PrefillPath(only, f"{only} (the only path here: {other}: {runnable[other]})")
    if setting == "auto" and not amx_cpu:
        return Bf16PrefillPath(NATIVE, "native (no AMX: oneDNN's bf16 matmuls run on the same "
                                       f"AVX-512 units; not measured, {PATH_ENV}=measure "
                                       "measures)")
    seconds = _measure(timer, rounds)
    fastest = min(seconds, key=lambda p: seconds[p])
    timings = ", ".join(f"{p} {seconds[p] * 1e3:.2f} ms" for p in (NATIVE, ATEN))
    why = "AMX tiles present" if setting == "auto" else f"{PATH_ENV}=measure"
    return Bf16PrefillPath(fastest, f"{fastest}, measured faster ({why}; 1x1024 causal bf16 "
                                    f"calibration call, best of {rounds}: {timings})", seconds)


def _measure(timer: Timer, rounds: int) -> dict[str, float]:
    for path in (NATIVE, ATEN):
        timer(path)  # warm-up: packing buffers, oneDNN's kernel generation
    best = {NATIVE: float("inf"), ATEN: float("inf")}
    for _ in range(rounds):
        for path in (NATIVE, ATEN):
            best[path] = min(best[path], timer(path))
    return best


_lock = threading.Lock()
_chosen: dict[str, Bf16PrefillPath] = {}   # per setting


def bf16_prefill_path(amx_cpu: bool, runnable: dict[str, str | None], timer: Timer
                      ) -> Bf16PrefillPath:
    """The choice for this process and setting: made on the first call (measuring if the rule
    says so) and kept. ``ValueError`` for a bad ``APP_CPU_PREFILL_PATH`` (read on every
    call)."""
    setting = read_path_setting()
    with _lock:
        choice = _chosen.get(setting)
        if choice is None:
            choice = _chosen[setting] = choose_bf16_prefill_path(setting, amx_cpu, runnable,
                                                                 timer)
        return choice


def reset_bf16_prefill_path() -> None:
    """Forget the choices (tests)."""
    with _lock:
        _chosen.clear()
