"""A native library's first self-test on a machine, run in a child process, and its verdict
kept beside the library.

A kernel built for instructions this machine never ran (AMX, written and tested on a CPU
without it) may not merely compute wrong numbers: an instruction the CPU or the kernel
refuses kills the process (SIGILL, SIGSEGV). So a library whose spec names ``child_test``
(``"module:NAME"``, where its :class:`~app.backends.cpu.loader.NativeLibrarySpec` can be
imported) is self-tested first in ``python -m app.backends.cpu.child_self_test``; only when
the child passes does this process run the self-test itself and use the library.

The verdict is a small JSON file beside the library (``<library>.verdict.json``), keyed by
the library's file name (its hash covers sources, compiler and flags) and by this machine's
CPU (model and flags: a home directory shared by machines with other CPUs gets another
verdict). A failed verdict is reused: the library is refused without running anything, and
is not rebuilt on every start (delete the file to test again). Kept only when the child said
something about the library: it crashed on a signal a faulting instruction raises, or its
self-test failed; a child that could not start, ran out of time or was killed by another
signal leaves no verdict (the library is refused in this process only). The file is trusted
only as the library itself is (a regular file owned by this user, not writable by others).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

__all__ = ["CHILD_MODULE", "CHILD_TIMEOUT_S", "IN_CHILD_ENV", "Verdict", "machine_key",
           "read_verdict", "run_child", "verdict_path", "write_verdict"]

#: The child's entry point (``python -m CHILD_MODULE SPEC_REF LIBRARY``).
CHILD_MODULE = "app.backends.cpu.child_self_test"
#: Set in the child: its loads run the self-test in process (no grandchild).
IN_CHILD_ENV = "APP_NATIVE_CHILD_SELF_TEST"
#: Seconds the child may take (it imports torch, then runs a small self-test).
CHILD_TIMEOUT_S = 300.0
#: Signals a faulting instruction raises: a crash on one of these is the library's verdict.
_FAULT_SIGNALS = {signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT}
_CPUINFO = Path("/proc/cpuinfo")


@attrs.frozen
class Verdict:
    """``passed``, and ``problem`` (what failed, when it did); ``cacheable``: whether it says
    something about the library (and so may be kept)."""

    passed: bool
    problem: str | None = None
    cacheable: bool = True


def machine_key() -> str:
    """A digest of this CPU's model name and flags (the first processor's)."""
    model, flags = "", ""
    with contextlib.suppress(OSError):
        for line in _CPUINFO.read_text(encoding="ascii", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    return hashlib.sha256(f"{model}\0{flags}".encode()).hexdigest()[:16]


def verdict_path(library: Path) -> Path:
    """Where the verdict of the library file ``library`` is kept."""
    return library.with_name(library.name + ".verdict.json")


def read_verdict(library: Path) -> Verdict | None:
    """The kept verdict of ``library`` on this machine, or None (none, unreadable, not
    trusted, another library or another CPU)."""
    path = verdict_path(library)
    try:
        st = os.lstat(path)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o022 or st.st_size > 65536):
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("library") != library.name \
            or data.get("machine") != machine_key() or not isinstance(data.get("passed"), bool):
        return None
    problem = data.get("problem")
    return Verdict(data["passed"], problem if isinstance(problem, str) else None)


def write_verdict(library: Path, verdict: Verdict) -> None:
    """Keep ``verdict`` beside ``library`` (atomically, mode 0600); a verdict that is not
    cacheable is not written. Errors writing it are ignored: the next start tests again."""
    if not verdict.cacheable:
        return
    payload = json.dumps({"library": library.name, "machine": machine_key(),
                          "passed": verdict.passed, "problem": verdict.problem})
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(prefix=".verdict-", dir=library.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(payload)
            os.chmod(tmp, 0o600)
            os.replace(tmp, verdict_path(library))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def run_child(spec_ref: str, library: Path, timeout: float = CHILD_TIMEOUT_S) -> Verdict:
    """Run the self-test of the spec at ``spec_ref`` (``"module:NAME"``) on the library file
    ``library`` in a child process; its verdict."""
    env = {**os.environ, IN_CHILD_ENV: "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", CHILD_MODULE, spec_ref, str(library)],
                              capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"the self-test in a child process took longer than "
                              f"{timeout:.0f} s", cacheable=False)
    except OSError as exc:
        return Verdict(False, f"could not start the self-test's child process: {exc}",
                       cacheable=False)
    if proc.returncode < 0:
        sig = -proc.returncode
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return Verdict(False, f"the self-test crashed its child process with {name}",
                       cacheable=sig in {int(s) for s in _FAULT_SIGNALS})
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if proc.returncode != 0 or not isinstance(answer, dict) or "problem" not in answer:
        tail = " ".join((proc.stderr or proc.stdout).split())[-400:]
        return Verdict(False, f"the self-test's child process failed (exit "
                              f"{proc.returncode}): {tail}", cacheable=False)
    problem = answer["problem"]
    if problem is None:
        return Verdict(True)
    return Verdict(False, f"in a child process: {problem}",
                   cacheable=bool(answer.get("about_library", True)))
