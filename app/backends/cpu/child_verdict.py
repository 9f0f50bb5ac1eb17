"""A native library's first self-test on a machine, run in a child process, and its verdict
kept beside the library.

A kernel built for instructions this machine never ran (AMX, written and tested on a CPU
without it) may not merely compute wrong numbers: an instruction the CPU or the kernel
refuses kills the process (SIGILL, SIGSEGV). So a library whose spec names ``child_test``
(``"module:NAME"``, where its :class:`~app.backends.cpu.loader.NativeLibrarySpec` can be
imported) is self-tested first in a child process (:mod:`app.backends.cpu.child_self_test`);
only when the child passes does this process run the self-test itself and use the library.
The child runs ``python -I`` (isolated: neither the current directory nor ``$PYTHONPATH`` nor
the user's site directory on ``sys.path``) with this package's own parent directory first on
its path, so it runs this package's code, never an ``app`` that happens to lie in the
directory the engine was started in. Other environment variables reach it as they are.

The verdict is a small JSON file beside the library (``<library>.verdict.json``), keyed by
the library's file name (its hash covers sources, compiler and flags) and by this machine's
CPU (model and flags: a home directory shared by machines with other CPUs gets another
verdict). A failed verdict is reused: the library is refused without running anything, and
is not rebuilt on every start (delete the file to test again). Kept only when the child said
something about the library: it crashed on a signal a faulting instruction raises, or its
self-test failed; a child that could not start, ran out of time or was killed by another
signal leaves no verdict (the library is refused in this process only). The file is trusted
only as the library itself is (a regular file owned by this user, not writable by others). A
file that is there but cannot be used (not trusted, not a regular file, too big, not the JSON
this module writes, however deeply nested) is ignored, and :func:`kept_verdict` says why: the
self-test runs again and its verdict replaces the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

from app._files import private_file_problem

__all__ = ["CHILD_MODULE", "CHILD_TIMEOUT_S", "IN_CHILD_ENV", "Verdict", "kept_verdict",
           "machine_key", "read_verdict", "run_child", "verdict_path", "write_verdict"]

#: The child's entry point (its ``main(SPEC_REF, LIBRARY)``).
CHILD_MODULE = "app.backends.cpu.child_self_test"
#: Set in the child: its loads run the self-test in process (no grandchild).
IN_CHILD_ENV = "APP_NATIVE_CHILD_SELF_TEST"
#: Seconds the child may take (it imports torch, then runs a small self-test).
CHILD_TIMEOUT_S = 300.0
#: Signals a faulting instruction raises: a crash on one of these is the library's verdict.
_FAULT_SIGNALS = {signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT}
_CPUINFO = Path("/proc/cpuinfo")
#: The most a verdict file may hold (the module writes a few hundred bytes).
_MAX_VERDICT_BYTES = 65536
#: What the child runs (``python -I -c``; argv: ``[FIRST, [LAST...]]`` as JSON, SPEC_REF,
#: LIBRARY): FIRST, this package's parent directory, goes first on ``sys.path``, LAST (see
#: ``_import_roots``) last; a child that still imports another ``app`` tests nothing.
_CHILD_CODE = """\
import json, os, sys
first, last = json.loads(sys.argv[1])
sys.path[:0] = [first]
sys.path += [p for p in last if p not in sys.path]
import app
if os.path.dirname(os.path.dirname(os.path.abspath(app.__file__))) != first:
    sys.stdout.write(json.dumps({"problem": f"the child imported app from {app.__file__}, "
                                 f"not from {first}", "about_library": False}) + "\\n")
    sys.stdout.flush()   # the verdict line, as child_self_test writes it: the protocol
    raise SystemExit(0)
from app.backends.cpu.child_self_test import main
raise SystemExit(main(sys.argv[2:]))
"""


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
    return kept_verdict(library)[0]


def kept_verdict(library: Path) -> tuple[Verdict | None, str | None]:
    """The kept verdict of ``library`` on this machine, or None; and, when a verdict file is
    there but ignored, why (not a regular file, not trusted, too big, unreadable, not the
    JSON this module writes). Never raises: a hostile file is ignored, not obeyed. A verdict
    another CPU left is ignored without a word (a home directory shared by machines)."""
    try:
        text = _verdict_text(verdict_path(library))
    except ValueError as exc:
        return None, str(exc)
    if text is None:
        return None, None
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"it is not JSON ({exc})"
    except RecursionError:  # "[[[[...": the parser's recursion, not a ValueError
        return None, "it is JSON nested too deeply to read"
    return _verdict_of(data, library)


def _untrusted(st: os.stat_result) -> str | None:
    problem = private_file_problem(st)
    if problem is not None:
        return problem
    if st.st_size > _MAX_VERDICT_BYTES:
        return f"it holds {st.st_size} bytes, more than the {_MAX_VERDICT_BYTES} a verdict may"
    return None


def _verdict_text(path: Path) -> str | None:
    """The verdict file's text, None if there is none; ``ValueError`` saying why it may not be
    read. Checked before it is opened and again on the open file (opened without following a
    link or waiting for a writer: a FIFO never blocks the start)."""
    try:
        problem = _untrusted(os.lstat(path))
        if problem is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY
                         | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                problem = _untrusted(os.fstat(f.fileno()))
                raw = b"" if problem else f.read(_MAX_VERDICT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"it cannot be read: {exc.strerror}") from None
    if problem is None and len(raw) > _MAX_VERDICT_BYTES:
        problem = f"it holds more than the {_MAX_VERDICT_BYTES} bytes a verdict may"
    if problem is not None:
        raise ValueError(problem)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8 text") from None


def _verdict_of(data: object, library: Path) -> tuple[Verdict | None, str | None]:
    """The verdict in the parsed file ``data``, or None and why it is not one."""
    if not isinstance(data, dict):
        return None, f"it holds a JSON {type(data).__name__}, not an object"
    fields: dict[str, type | tuple[type, ...]] = {
        "library": str, "machine": str, "passed": bool, "problem": (str, type(None))}
    for key, kind in fields.items():
        if not isinstance(data.get(key), kind):  # bool: never an int, a string or null
            return None, f"its {key!r} is {_short(data.get(key))}"
    if data["library"] != library.name:
        return None, f"it is the verdict of another library, {_short(data['library'])}"
    if data["machine"] != machine_key():
        return None, None
    return Verdict(data["passed"], data["problem"]), None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    # -I ignores the PYTHON* variables only: the package's own switches reach the child.
    env = {**os.environ, IN_CHILD_ENV: "1"}
    roots = json.dumps(_import_roots(spec_ref))
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", _CHILD_CODE, roots, spec_ref,
                               str(library)], capture_output=True, text=True, timeout=timeout,
                              env=env, check=False)
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


def _import_roots(spec_ref: str) -> tuple[str, list[str]]:
    """Where the child imports from: this package's parent directory (first), then (after the
    child's own standard library and site directories) the directories the spec's top-level
    module was imported from here and this process's own absolute ``sys.path`` entries (a
    user site directory, ``$PYTHONPATH``, an embedding program's), never the current
    directory: the child finds what this process finds, and this package's code first."""
    first = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    top = sys.modules.get(spec_ref.partition(":")[0].partition(".")[0])
    file, path = getattr(top, "__file__", None), getattr(top, "__path__", None)
    dirs: list[str] = []
    if path is not None:  # a package (its directories' parents)
        dirs = [os.path.dirname(os.path.abspath(p)) for p in path]
    elif file:  # a top-level module file
        dirs = [os.path.dirname(os.path.abspath(str(file)))]
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # removed since: nothing can be imported from it
        cwd = None
    dirs += [p for p in sys.path if isinstance(p, str) and os.path.isabs(p) and p != cwd]
    return first, [d for d in dict.fromkeys(dirs) if d != first]
