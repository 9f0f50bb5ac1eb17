"""Build, cache, check and load the package's native C libraries (``app/backends/cpu/csrc/``).

One loader serves every C kernel of the package. A kernel module describes its library with a
:class:`NativeLibrarySpec` and calls :func:`load_native_library`, which returns a
:class:`NativeLibraryStatus`: ``.library`` (a :class:`NativeLibrary`) when it is usable, else
``.reasons`` saying why not. A library that cannot be built or loaded is never an error: the
caller falls back and reports the reasons (``python -m app platform`` prints them).

Conventions for a kernel author (the C side is ``csrc/app_native.h``):

1. **Sources** live in ``app/backends/cpu/csrc/`` (shipped as package data: ``*.c``, ``*.h``)
   and ``#include "app_native.h"``. They are compiled with ``-fPIC -shared
   -fvisibility=hidden -I app/backends/_native`` plus the spec's ``flags``, so only names
   marked ``APP_NATIVE_EXPORT`` are visible. Exactly one source of a library says
   ``APP_NATIVE_LIBRARY(<abi version>)``.
2. **ABI version**: the library exports ``app_native_abi_version()``; the loader refuses a
   library whose version is not ``spec.abi_version``. Bump both on every change to an exported
   function's signature or meaning.
3. **Arguments as one struct**: declare it in C with ``APP_NATIVE_STRUCT(name, FIELDS)`` from an
   X-macro field list, export its layout with ``APP_NATIVE_STRUCT_LAYOUT(name, FIELDS)``, and
   mirror it with a ``ctypes.Structure`` listed in ``spec.structs`` as ``(name, Structure)``.
   At load the size, field count and every field's offset must agree, or the library is
   refused. Use fixed-size C types (``int64_t``, ``int32_t``, ``float``, pointers) and
   ``ctypes.c_int64`` / ``c_int32`` / ``c_float`` / ``c_void_p`` for them.
4. **Element types**: codes are defined once, in ``app_native.h``; Python never writes them
   down. :attr:`NativeLibrary.dtype_codes` asks the library (``app_native_dtype_code``).
5. **Self-test**: ``spec.self_test(library)`` runs after the ABI check and returns ``None`` or
   what went wrong (it should compare against a float64 reference on a small problem).
6. **Calling**: :meth:`NativeLibrary.function` declares a function's types. ctypes releases
   the GIL during a call; to run shares of a call on several threads use
   :func:`app.backends.cpu.pool.run_shares`, which waits for every share even on error, so
   no kernel work outlives the tensors it writes.

Where libraries live, and what is trusted: a library is compiled once per (sources, headers,
compiler, flags, ABI version) into the first usable of ``$APP_CACHE_DIR/cpu-kernels`` (else
``$XDG_CACHE_HOME/app/cpu-kernels``, else ``~/.cache/app/cpu-kernels``) and the per-user
``<tmp>/app-<uid>``. Loading a shared library runs its constructors before any check can, so
a directory is used only when it is owned by the current user and not writable by group or
others, and each ancestor is owned by the user or root and either not writable by group or
others or sticky (as ``/tmp``). Directories the loader creates get mode 0700. A refused
directory is skipped and the reason kept in ``NativeLibraryStatus.notes`` (or ``reasons``,
when none is usable). A directory that cannot take a build (read-only, full) is skipped for
the next, with a note; what it holds is still loaded (a read-only image's cache). A cached
file is loaded only if it is a regular file owned by the user and not writable by group or
others. A build runs in a fresh private directory (``mkdtemp``), is loaded and checked there,
and is renamed into place atomically only once it passes. A cached library that does not
load ("invalid ELF header"), fails the ABI check or fails its self-test is rebuilt once, and
replaced only when the rebuilt one passes: when the rebuilt one fails too, the failure is
not the cached file's (the environment, the CPU) and the cached file is kept.

A library that may crash the process rather than merely compute wrong numbers (instructions
this machine never ran: AMX) names where its spec can be imported (``spec.child_test``,
``"module:NAME"``): its first self-test on a machine then runs in a child process, and the
verdict is kept beside the library, keyed by its file name and the CPU
(:mod:`app.backends.cpu.child_verdict`); a failed verdict refuses the library at once, without
a rebuild. A verdict file that cannot be used is ignored, with a note, and replaced.

Settings: every on/off switch a library or its self-test reads is listed in
``spec.switches`` and checked by :func:`load_native_library`, by name, before anything is
built, loaded or deleted (``ValueError``; nothing cached). A bad value therefore never fails a
self-test, which would have cost a valid cached library on every start.

For tests, ``APP_CPU_EMULATE_AVX512=1`` (:mod:`app._cpu.emulation`) builds a ``-mavx512*``
library for AVX2 with SIMDe's emulation instead (its own cache file; a note says EMULATED) on
a CPU without AVX-512; the instruction check still reads the CPU's own flags.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from app._cpu import avx512_emulation, cpu_flags, real_cpu_flags, required_cpu_flags
from app._cpu.emulation import (
    EMULATE_ENV,
    EMULATION_HEADER,
    emulated_build_flags,
    find_compiler,
)
from app._files import private_file_problem
from app.backends.cpu import child_verdict

logger = logging.getLogger(__name__)

__all__ = ["CACHE_DIR_ENV", "NATIVE_DIR", "NativeLibrary", "NativeLibrarySpec",
           "NativeLibraryStatus", "cache_directories", "check_library_file", "cpu_flags",
           "directory_problem", "find_compiler", "load_native_library", "on_build", "read_switch",
           "required_cpu_flags", "reset_native_libraries"]

#: Where the C sources and headers live.
NATIVE_DIR = Path(__file__).with_name("csrc")
#: Overrides the cache directory (libraries go to ``$APP_CACHE_DIR/cpu-kernels``).
CACHE_DIR_ENV = "APP_CACHE_DIR"
#: Flags every library is built with, before the spec's own.
_BASE_FLAGS = ("-fPIC", "-shared", "-fvisibility=hidden")
_SWITCH_VALUES = {"": True, "1": True, "true": True, "on": True, "yes": True,
                  "0": False, "false": False, "off": False, "no": False}
#: torch dtypes whose code :attr:`NativeLibrary.dtype_codes` asks every library for.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
           torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
#: Errors that say a directory cannot take a new file, whatever its mode says.
_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})


@attrs.frozen
class NativeLibrarySpec:
    """What to build and how to check it.

    ``name``: the library's file stem (unique in the package); ``sources``: file names in
    ``app/backends/cpu/csrc/`` (an absolute path is taken as it is: tests); ``flags``: compiler
    flags after the base ones (optimisation, ``-m`` ISA flags, ``-D``); ``link_flags``: after
    the sources; ``abi_version``: what ``app_native_abi_version()`` must return; ``structs``:
    ``(C struct name, ctypes.Structure)`` pairs whose layouts must agree; ``self_test``:
    returns ``None`` or what is wrong; ``requirements``: returns why the library cannot run
    here (CPU, switches; a C compiler is checked by the loader); it may raise ``ValueError``
    for a bad setting; ``switches``: the on/off environment variables the library, its
    requirements or its self-test read (``read_switch``), checked by the loader first;
    ``child_test``: ``"module:NAME"`` where this spec can be imported, to run its first
    self-test on a machine in a child process (see the module docstring).
    """

    name: str
    sources: tuple[str, ...]
    abi_version: int
    flags: tuple[str, ...] = ("-O3",)
    link_flags: tuple[str, ...] = ("-lm",)
    structs: tuple[tuple[str, type[ctypes.Structure]], ...] = ()
    self_test: Callable[[NativeLibrary], str | None] | None = None
    requirements: Callable[[], Sequence[str]] | None = None
    switches: tuple[str, ...] = ()
    child_test: str | None = None


class NativeLibrary:
    """A loaded, checked library: ``cdll`` (the ``ctypes.CDLL``), ``path``, ``spec``."""

    def __init__(self, spec: NativeLibrarySpec, path: Path, cdll: ctypes.CDLL,
                 dtype_codes: Mapping[torch.dtype, int]) -> None:
        self.spec = spec
        self.path = path
        self.cdll = cdll
        #: The library's element-type codes for the torch dtypes it knows.
        self.dtype_codes: Mapping[torch.dtype, int] = dict(dtype_codes)

    def function(self, name: str, restype: Any, *argtypes: Any) -> Any:
        """The exported function ``name`` with its result and argument types declared."""
        fn = getattr(self.cdll, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)
        return fn

    def dtype_code(self, dtype: torch.dtype) -> int:
        """The library's code for ``dtype``; ``ValueError`` if it has none."""
        code = self.dtype_codes.get(dtype)
        if code is None:
            known = "/".join(str(d).removeprefix("torch.") for d in self.dtype_codes)
            raise ValueError(f"native library {self.spec.name}: expected one of {known}, "
                             f"got {dtype}")
        return code


@attrs.frozen(eq=False)
class NativeLibraryStatus:
    """The outcome of :func:`load_native_library`.

    ``available``: ``library`` is usable; ``reasons``: why not; ``path``: the library file;
    ``notes``: what happened on the way that the user should hear of (a refused cache
    directory, a rebuilt corrupt file) even when the library is usable.
    """

    available: bool
    reasons: tuple[str, ...] = ()
    path: Path | None = None
    notes: tuple[str, ...] = ()
    library: NativeLibrary | None = None


# -- environment ---------------------------------------------------------------------------

def read_switch(env: str) -> bool:
    """An on/off environment variable read strictly: unset/1/true/on/yes or 0/false/off/no."""
    raw = os.environ.get(env, "")
    value = _SWITCH_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"{env}: expected one of 1/true/on/yes or 0/false/off/no "
                         f"(or unset), got {raw!r}")
    return value


# -- the cache directory -------------------------------------------------------------------

def cache_directories() -> tuple[Path, ...]:
    """Where libraries may be cached, in order of preference."""
    base = os.environ.get(CACHE_DIR_ENV)
    dirs = []
    if base:
        dirs.append(Path(base) / "cpu-kernels")
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        try:
            root = Path(xdg) if xdg else Path.home() / ".cache"
        except RuntimeError:  # no home directory
            root = None
        if root is not None:
            dirs.append(root / "app" / "cpu-kernels")
    dirs.append(Path(tempfile.gettempdir()) / f"app-{os.geteuid()}")
    return tuple(Path(os.path.abspath(d)) for d in dirs)


def directory_problem(path: Path) -> str | None:
    """Why ``path`` may not hold libraries this process loads, or ``None`` if it may."""
    uid = os.geteuid()
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"{real}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a directory"
    if st.st_uid != uid:
        return f"{real} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return (f"{real} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}; "
                f"chmod go-w it)")
    for parent in real.parents:
        try:
            pst = os.stat(parent)
        except OSError as exc:
            return f"{parent}: {exc.strerror}"
        if pst.st_uid not in (0, uid):
            return (f"{real}: its parent {parent} is owned by uid {pst.st_uid}, neither this "
                    f"user (uid {uid}) nor root")
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return (f"{real}: its parent {parent} is writable by group or others and not "
                    f"sticky (mode {stat.S_IMODE(pst.st_mode):o})")
    return None


def _make_private_directory(path: Path) -> str | None:
    """Create ``path`` (and missing parents) with mode 0700; why it is unusable, if it is."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"cannot create {d}: {exc.strerror}"
    return directory_problem(path)


def _file_problem(path: Path) -> str | None:
    """Why the cached file ``path`` may not be loaded, or ``None``."""
    return private_file_problem(os.lstat(path))


# -- building ------------------------------------------------------------------------------

_build_listeners: list[Callable[[str], None]] = []


@contextlib.contextmanager
def on_build(callback: Callable[[str], None]) -> Iterator[None]:
    """Within the block, call ``callback(library name)`` as each native library starts
    compiling (the first use on a machine: seconds each), so a command can say why it is
    quiet. The callback runs on the loading thread; it must not load a library itself."""
    _build_listeners.append(callback)
    try:
        yield
    finally:
        _build_listeners.remove(callback)


def _announce_build(name: str) -> None:
    logger.info("compiling native library %s (first use with these sources)", name)
    for callback in list(_build_listeners):
        callback(name)


def _library_file_name(spec: NativeLibrarySpec, compiler: str) -> str:
    """``<name>-<hash>.so``: the hash covers sources, headers, compiler, flags and ABI."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    digest = hashlib.sha256()
    for part in (spec.name, str(spec.abi_version), compiler, version, *_BASE_FLAGS,
                 *spec.flags, "|", *spec.link_flags):
        digest.update(part.encode() + b"\0")
    for file in [*(NATIVE_DIR / s for s in spec.sources), *sorted(NATIVE_DIR.glob("*.h"))]:
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return f"{spec.name}-{digest.hexdigest()[:16]}.so"


class _NotWritable(Exception):
    """A cache directory cannot take a build (read-only, full): the next one is tried."""


def _not_writable(exc: OSError) -> _NotWritable | OSError:
    return _NotWritable(exc.strerror or str(exc)) if exc.errno in _NOT_WRITABLE else exc


def _build_and_open(spec: NativeLibrarySpec, compiler: str, target: Path
                    ) -> tuple[NativeLibrary | None, str]:
    """Compile into a fresh private directory, load and check the library there, and only
    when it passes rename it onto ``target`` (atomic: a concurrent loader sees the old file or
    the whole new one); the library, or ``None`` and what is wrong (``target`` untouched).
    ``_NotWritable`` when ``target``'s directory cannot take the build."""
    try:
        build_dir = Path(tempfile.mkdtemp(prefix=f".{spec.name}-build-", dir=target.parent))
    except OSError as exc:
        raise _not_writable(exc) from None
    _announce_build(spec.name)
    try:
        out = build_dir / target.name
        cmd = [compiler, *_BASE_FLAGS, *spec.flags, "-I", str(NATIVE_DIR), "-o", str(out),
               *(str(NATIVE_DIR / s) for s in spec.sources), *spec.link_flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode:
            if any(os.strerror(e) in proc.stderr for e in (errno.ENOSPC, errno.EDQUOT)):
                raise _NotWritable(f"{compiler} could not write the library: "
                                   f"{proc.stderr[-400:].strip()}")
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.chmod(out, 0o700)
        library, problem = _open(spec, out, target)
        if library is not None:
            try:
                os.replace(out, target)
            except OSError as exc:
                _close(library.cdll)
                raise _not_writable(exc) from None
            library.path = target
        return library, problem
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


# -- loading and checking ------------------------------------------------------------------

def _abi_problem(spec: NativeLibrarySpec, cdll: ctypes.CDLL
                 ) -> tuple[str | None, dict[torch.dtype, int]]:
    """Why the library's exports disagree with ``spec`` (or ``None``), and its dtype codes."""
    try:
        version_fn = cdll.app_native_abi_version
        code_fn = cdll.app_native_dtype_code
    except AttributeError as exc:
        return f"not an app native library (missing {exc})", {}
    version_fn.restype, version_fn.argtypes = ctypes.c_int64, []
    code_fn.restype, code_fn.argtypes = ctypes.c_int32, [ctypes.c_char_p]
    version = version_fn()
    if version != spec.abi_version:
        return f"ABI version {version}, expected {spec.abi_version}", {}
    codes = {}
    for dtype in _DTYPES:
        code = code_fn(str(dtype).removeprefix("torch.").encode())
        if code >= 0:
            codes[dtype] = int(code)
    for name, struct in spec.structs:
        problem = _struct_problem(cdll, name, struct)
        if problem:
            return problem, {}
    return None, codes


def _struct_problem(cdll: ctypes.CDLL, name: str, struct: type[ctypes.Structure]) -> str | None:
    try:
        layout = getattr(cdll, f"app_native_layout_{name}")
    except AttributeError:
        return f"struct {name}: the library exports no layout for it"
    layout.restype, layout.argtypes = ctypes.c_int64, [ctypes.c_char_p]
    fields = [f[0] for f in struct._fields_]
    size, count = layout(None), layout(b"#fields")
    if size != ctypes.sizeof(struct) or count != len(fields):
        return (f"struct {name}: {count} fields in {size} bytes in C, {len(fields)} in "
                f"{ctypes.sizeof(struct)} bytes in {struct.__name__}")
    for field in fields:
        offset, expected = layout(field.encode()), getattr(struct, field).offset
        if offset != expected:
            return f"struct {name}: field {field} at offset {offset} in C, {expected} in Python"
    return None


def _close(cdll: ctypes.CDLL) -> None:
    """Unload a library that failed its checks, so that a rebuilt file at the same path is
    really loaded (the dynamic loader would hand back the old one by name)."""
    import _ctypes

    with contextlib.suppress(OSError):  # nothing more to do then
        _ctypes.dlclose(cdll._handle)


def _open(spec: NativeLibrarySpec, path: Path, target: Path | None = None
          ) -> tuple[NativeLibrary | None, str]:
    """Load ``path`` and check it; the library, or ``None`` and what is wrong. ``target``:
    the cache file ``path`` is (or becomes), whose verdict a ``child_test`` spec keeps."""
    if spec.child_test and target is not None and not os.environ.get(
            child_verdict.IN_CHILD_ENV):
        verdict = child_verdict.read_verdict(target)
        if verdict is None:
            verdict = child_verdict.run_child(spec.child_test, path)
            child_verdict.write_verdict(target, verdict)
        if not verdict.passed:
            return None, str(verdict.problem)
    try:
        cdll = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load it: {exc}"
    problem, codes = _abi_problem(spec, cdll)
    library = NativeLibrary(spec, path, cdll, codes)
    if problem is None and spec.self_test is not None:
        try:
            problem = spec.self_test(library)
        except Exception as exc:  # a self-test that raises is a failed self-test
            problem = f"self-test raised {type(exc).__name__}: {exc}"
    if problem is not None:
        _close(cdll)
        return None, problem
    return library, ""


def _isa_problem(spec: NativeLibrarySpec) -> str | None:
    """Why this CPU cannot run code built with ``spec.flags`` (read here, from the kernel's
    own ``/proc/cpuinfo``, never from a module a caller or a test may have patched): a
    library whose instructions the CPU lacks dies with SIGILL at its first call, so no
    ``requirements`` function, however it is fooled, can get it loaded."""
    have = real_cpu_flags()
    missing = sorted(required_cpu_flags(spec.flags) - have)
    if not missing or not have:  # no flags line (not Linux, not x86): the requirements decide
        return None
    return (f"built for {', '.join(missing)}, which this CPU lacks (its /proc/cpuinfo flags "
            f"do not list {'it' if len(missing) == 1 else 'them'})")


def _load(spec: NativeLibrarySpec) -> NativeLibraryStatus:
    reasons = list(spec.requirements()) if spec.requirements is not None else []
    flags, emulation_note = emulated_build_flags(spec.flags, avx512_emulation(),
                                                 NATIVE_DIR / EMULATION_HEADER)
    spec = attrs.evolve(spec, flags=flags)  # the same flags but where AVX-512 is emulated
    isa_problem = _isa_problem(spec)
    if isa_problem is not None and not reasons:
        reasons.append(isa_problem)
    compiler = find_compiler()
    if compiler is None:
        reasons.append("needs a C compiler to build it (set CC, or install cc/gcc/clang)")
    notes = [emulation_note] if emulation_note else []
    if reasons or compiler is None:
        return NativeLibraryStatus(False, tuple(reasons), notes=tuple(notes))
    for directory in cache_directories():
        problem = _make_private_directory(directory)
        if problem is not None:
            notes.append(f"refused cache directory {directory}: {problem}")
            continue
        try:
            return _load_in(spec, compiler, directory, notes)
        except _NotWritable as exc:
            notes.append(f"cache directory {directory} cannot take a build ({exc}); tried the "
                         f"next one")
    return NativeLibraryStatus(False, ("no usable cache directory: " + "; ".join(notes),))


def _load_in(spec: NativeLibrarySpec, compiler: str, directory: Path, notes: list[str]
             ) -> NativeLibraryStatus:
    """Load ``spec``'s library cached in ``directory``, or build it there (``_NotWritable``)."""
    cached_problem: str | None = None
    try:
        target = directory / _library_file_name(spec, compiler)
        failed = _failed_verdict(spec, target, notes)
        if failed is not None:  # refused on this machine before: neither run nor rebuilt
            return NativeLibraryStatus(False, (failed,), None, tuple(notes))
        if os.path.lexists(target):
            cached_problem = _file_problem(target)
            if cached_problem is None:
                library, problem = _open(spec, target, target)
                if library is not None:
                    return NativeLibraryStatus(True, (), target, tuple(notes), library)
                cached_problem = problem
        library, problem = _build_and_open(spec, compiler, target)
    except _NotWritable as exc:
        if cached_problem is None:
            raise
        raise _NotWritable(f"{exc}; its cached {target.name} is unusable: "
                           f"{cached_problem}") from None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return NativeLibraryStatus(False, (f"could not build or load it: {exc}",), None,
                                   tuple(notes))
    if library is None:
        if cached_problem is not None:
            # The same checks fail on a fresh build: not the cached file's fault, so it stays.
            notes.append(f"cached {target.name} failed ({cached_problem}) and so does a fresh "
                         f"build; kept the cached file")
        return NativeLibraryStatus(False, (f"freshly built {target.name}: {problem}",), None,
                                   tuple(notes))
    if cached_problem is not None:
        notes.append(f"cached {target.name} was unusable ({cached_problem}); rebuilt it")
    return NativeLibraryStatus(True, (), target, tuple(notes), library)


def _failed_verdict(spec: NativeLibrarySpec, target: Path, notes: list[str]) -> str | None:
    """Why ``target`` failed its child-process self-test on this machine before, or None; a
    kept verdict that cannot be used is ignored, with a note (the test runs again)."""
    if not spec.child_test or os.environ.get(child_verdict.IN_CHILD_ENV):
        return None
    verdict, ignored = child_verdict.kept_verdict(target)
    if ignored is not None:
        notes.append(f"ignored the kept verdict {child_verdict.verdict_path(target)} "
                     f"({ignored}); the self-test runs again and its verdict replaces it")
    if verdict is None or verdict.passed:
        return None
    return (f"{target.name} failed its self-test on this machine (kept in "
            f"{child_verdict.verdict_path(target)}; delete it to test again): {verdict.problem}")


def check_library_file(spec: NativeLibrarySpec, path: Path) -> str | None:
    """Load the library file ``path`` and run ``spec``'s checks (ABI, layouts, self-test) in
    this process, as a child-process self-test does: None when it passes, else what is
    wrong. The library stays loaded when it passes."""
    return _open(spec, Path(path))[1] or None


def _check_switches(spec: NativeLibrarySpec) -> None:
    """``ValueError`` naming the first of ``spec.switches`` (and, for an AVX-512 library, the
    emulation's) set to a value ``read_switch`` refuses: a setting is the user's to fix, never
    a reason to rebuild or delete a library."""
    for env in spec.switches:
        read_switch(env)
    if any(f.startswith("-mavx512") for f in spec.flags):
        read_switch(EMULATE_ENV)


_lock = threading.RLock()  # re-entrant: a self-test may load another library
_results: dict[str, tuple[NativeLibrarySpec, NativeLibraryStatus]] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def load_native_library(spec: NativeLibrarySpec) -> NativeLibraryStatus:
    """Build (first use), check and load ``spec``'s library, once per process (thread-safe).

    Never raises for a library that cannot be built or loaded: the status says why (and is
    logged once at INFO). Raises ``ValueError`` when one of ``spec.switches`` has a bad value
    (checked on every call, before anything else), when ``spec.requirements`` raises (a bad
    setting; nothing is cached then) or another spec already uses ``spec.name``.
    """
    _check_switches(spec)
    with _lock:
        cached = _results.get(spec.name)
        if cached is not None:
            if cached[0] != spec:
                raise ValueError(f"native library {spec.name!r}: two different specs use "
                                 f"this name")
            return cached[1]
        status = _load(spec)
        _results[spec.name] = (spec, status)
    if not status.available:
        logger.info("native library %s unavailable: %s", spec.name, "; ".join(status.reasons))
    for note in status.notes:
        logger.warning("native library %s: %s", spec.name, note)
    return status


def reset_native_libraries(name: str | None = None) -> None:
    """Forget loaded libraries (``name``'s, or all), so the next load probes again (tests)."""
    with _lock:
        if name is None:
            _results.clear()
        else:
            _results.pop(name, None)
