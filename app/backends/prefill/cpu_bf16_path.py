"""Which kernel TORCH_SDPA runs bf16 prefill on, on a CPU: ours or aten's (oneDNN), chosen by
measured speed where it can go either way.

Two candidates compute bf16 prefill with the LSE and context chunks:

- ``native``: this package's kernel (``cpu/csrc/mla_prefill_cpu.c``; its bf16-products
  build, ``vdpbf16ps``, on AVX512-BF16 CPUs, else its float32 math);
- ``aten``: aten's CPU flash-attention kernel in bf16 (``app.backends.prefill._aten_cpu``),
  whose blocks are oneDNN brgemm calls: on a CPU with AMX tiles oneDNN runs them on AMX.

The rule (``APP_CPU_PREFILL_PATH``), the same in every process on a machine:

- ``auto`` (default): on a CPU with AMX tiles, the faster of the two on one calibration call
  (1 request x 1024 new tokens, causal, 16 heads, DeepSeek's 192/128 head dims, with the
  LSE; best of 3 each, interleaved, after a warm-up), **measured once per machine** and kept
  in a file beside the native kernel library (:class:`CalibrationFile`: keyed by the CPU,
  the libraries, torch's version and the thread count), as the AMX kernel's verdict is
  (``app.backends.cpu.child_verdict``): later processes read it and never re-time, so two
  runs of one job take the same kernel even on a busy machine, where a timing can flip
  (delete the file, or run once with ``measure``, to measure again). The first process to
  keep a measurement wins: one that measured at the same time takes the kept one. Where
  nothing can be kept (no library file), the process measures for itself and says so.
  Elsewhere ``native`` without measuring (measured on AVX512-BF16 EPYCs: ~2x aten's bf16
  kernel, docs/benchmarks.md). ``APP_CPU_AMX=0`` on an AMX CPU: ``native`` without
  measuring (aten's bf16 kernel would run on oneDNN's AMX tiles; where only aten can run,
  it computes in float32 then: ``app.backends.prefill._aten_cpu.cpu_compute_dtype``). A
  path that cannot run here is not a candidate.
- ``measure``: measure now, on any CPU, and keep the result (replacing a kept one);
  ``native`` / ``aten``: that path, unmeasured.

:func:`bf16_prefill_path` gives the choice and why (``python -m app platform``, the selector's
``kernel_path``). The measuring is passed in (``timer(path) -> seconds``): TORCH_SDPA supplies
it, so this module imports no backend; tests give their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

__all__ = ["ATEN", "NATIVE", "PATH_ENV", "PATH_VALUES", "Bf16PrefillPath", "CalibrationFile",
           "bf16_prefill_path", "choose_bf16_prefill_path", "read_path_setting",
           "reset_bf16_prefill_path"]

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


@attrs.frozen(eq=False)
class CalibrationFile:
    """Where a machine's calibration is kept: a JSON file in ``directory`` (the native
    library's), named by a digest of ``key`` (what the timings hold for: the CPU, the
    libraries, torch's version, the thread count) and holding the key too. Trusted only as
    a library file is: a regular file of this user, not writable by others."""

    directory: Path
    key: Mapping[str, str]

    @property
    def path(self) -> Path:
        """The file."""
        digest = hashlib.sha256(json.dumps(dict(self.key), sort_keys=True).encode())
        return self.directory / f"bf16-prefill-path-{digest.hexdigest()[:16]}.json"

    def read(self) -> dict[str, float] | None:
        """The kept timings (path -> seconds), or None (none, unreadable, not trusted, or
        for another key)."""
        try:
            st = os.lstat(self.path)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                    or st.st_mode & 0o022 or st.st_size > 65536):
                return None
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        seconds = data.get("seconds") if isinstance(data, dict) else None
        if data.get("key") != dict(self.key) or not isinstance(seconds, dict):
            return None
        if sorted(seconds) != sorted((NATIVE, ATEN)) or not all(
                isinstance(v, float) and v > 0 for v in seconds.values()):
            return None
        return {NATIVE: seconds[NATIVE], ATEN: seconds[ATEN]}

    def keep(self, seconds: dict[str, float], replace: bool) -> tuple[dict[str, float], str]:
        """Keep ``seconds`` (``replace``: over a kept one; else the first kept wins) and
        return the timings now kept and how (``"kept in FILE"``, ``"kept in FILE by another
        process first"``, or why nothing could be kept: then ``seconds`` themselves)."""
        payload = json.dumps({"key": dict(self.key), "seconds": seconds})
        try:
            fd, tmp = tempfile.mkstemp(prefix=".bf16-path-", dir=self.directory)
        except OSError as exc:
            return seconds, f"not kept ({exc.strerror or exc}): measured in this process"
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(payload)
            os.chmod(tmp, 0o600)
            if not replace and not os.path.lexists(self.path):
                _link_first(tmp, self.path)       # a process that got there first wins
            elif replace or self.read() is None:  # a stale or foreign file is replaced
                os.replace(tmp, self.path)
        except OSError as exc:
            return seconds, f"not kept ({exc.strerror or exc}): measured in this process"
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        kept = self.read()
        if kept is None:
            return seconds, (f"not kept (could not read {self.path} back): measured in "
                             f"this process")
        if kept != seconds:
            return kept, f"kept in {self.path} by another process first"
        return kept, f"kept in {self.path}"


def _link_first(tmp: str, path: Path) -> None:
    """``tmp`` at ``path`` unless a file got there first (then that one stays)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return


def read_path_setting() -> str:
    """``APP_CPU_PREFILL_PATH`` (default ``auto``); ``ValueError`` naming the values
    allowed for anything else."""
    raw = os.environ.get(PATH_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in PATH_VALUES:
        raise ValueError(f"{PATH_ENV}: expected one of {', '.join(PATH_VALUES)} (or unset), "
                         f"got {raw!r}")
    return value


def _unmeasured(setting: str, amx_cpu: bool, amx_off: bool, usable: list[str],
                runnable: dict[str, str | None]) -> Bf16PrefillPath | None:
    """The choice where the rule measures nothing (forced, one candidate, no AMX, AMX
    switched off), else None."""
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
    if setting == "auto" and amx_cpu and amx_off:
        return Bf16PrefillPath(NATIVE, "native (APP_CPU_AMX=0: aten's bf16 kernel would run on "
                                       "oneDNN's AMX tiles; not measured)")
    if setting == "auto" and not amx_cpu:
        return Bf16PrefillPath(NATIVE, "native (no AMX: oneDNN's bf16 matmuls run on the same "
                                       f"AVX-512 units; not measured, {PATH_ENV}=measure "
                                       "measures)")
    return None


def choose_bf16_prefill_path(setting: str, amx_cpu: bool, runnable: dict[str, str | None],
                             timer: Timer, rounds: int = ROUNDS, *, amx_off: bool = False,
                             kept: CalibrationFile | None = None) -> Bf16PrefillPath:
    """The rule of the module docstring. ``runnable``: each path -> None when it can run
    here, else why not; ``amx_off``: ``APP_CPU_AMX=0``; ``kept``: where this machine's
    calibration is kept (None: nowhere, measured per process); ``timer`` is called only when
    the rule measures and nothing is kept."""
    usable = [p for p in (NATIVE, ATEN) if runnable.get(p) is None]
    if not usable:
        why = "; ".join(f"{p}: {runnable.get(p)}" for p in (NATIVE, ATEN))
        return Bf16PrefillPath(ATEN, f"neither path can run ({why}); aten's kernel")
    fixed = _unmeasured(setting, amx_cpu, amx_off, usable, runnable)
    if fixed is not None:
        return fixed
    found = kept.read() if kept is not None and setting == "auto" else None
    if found is not None:
        seconds, how = found, f"kept in {kept.path if kept else ''}; not re-timed"
    else:
        seconds = _measure(timer, rounds)
        seconds, how = (kept.keep(seconds, replace=setting == "measure") if kept is not None
                        else (seconds, "measured in this process"))
    fastest = min((NATIVE, ATEN), key=lambda p: seconds[p])
    timings = ", ".join(f"{p} {seconds[p] * 1e3:.2f} ms" for p in (NATIVE, ATEN))
    why = "AMX tiles present" if setting == "auto" else f"{PATH_ENV}=measure"
    return Bf16PrefillPath(fastest, f"{fastest}, measured faster ({why}; 1x1024 causal bf16 "
                                    f"calibration call, best of {rounds}: {timings}; {how})",
                           seconds)


def _measure(timer: Timer, rounds: int) -> dict[str, float]:
    for path in (NATIVE, ATEN):
        timer(path)  # warm-up: packing buffers, oneDNN's kernel generation
    best = {NATIVE: float("inf"), ATEN: float("inf")}
    for _ in range(rounds):
        for path in (NATIVE, ATEN):
            best[path] = min(best[path], timer(path))
    return best


_lock = threading.Lock()
_chosen: dict[tuple[str, bool], Bf16PrefillPath] = {}   # per setting and AMX switch


def bf16_prefill_path(amx_cpu: bool, runnable: dict[str, str | None], timer: Timer, *,
                      amx_off: bool = False,
                      kept: Callable[[], CalibrationFile | None] | None = None
                      ) -> Bf16PrefillPath:
    """The choice for this process, setting and ``APP_CPU_AMX`` switch (``amx_off``): made
    on the first call (read from the file ``kept()`` names, or measured and kept there, if
    the rule says so) and kept. ``ValueError`` for a bad ``APP_CPU_PREFILL_PATH`` (read on
    every call)."""
    setting = read_path_setting()
    with _lock:
        choice = _chosen.get((setting, amx_off))
        if choice is None:
            choice = _chosen[(setting, amx_off)] = choose_bf16_prefill_path(
                setting, amx_cpu, runnable, timer, amx_off=amx_off,
                kept=kept() if kept is not None else None)
        return choice


def reset_bf16_prefill_path() -> None:
    """Forget the choices (tests)."""
    with _lock:
        _chosen.clear()
