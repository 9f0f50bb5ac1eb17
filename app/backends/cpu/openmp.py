"""Which OpenMP runtime torch runs its ops on, and whether a native library shares it.

A native kernel built with ``-fopenmp`` may run its shares on the calling thread's OpenMP team
(the threads torch's own ops just ran on, still spinning awake) only when it is bound to the
very runtime torch loaded: a second OpenMP runtime in the process would start a second set of
threads competing with torch's for the same cores. GCC's ``-fopenmp`` links ``libgomp.so.1``;
when torch has already loaded a library of that name (torch's CPU wheels ship one), the dynamic
loader binds ours to it (same SONAME). :func:`torch_libgomp` finds that library and
:func:`runtime_function_address` lets a loader compare the address the kernel library bound
``omp_get_max_threads`` to against torch's own: the proof, not the file name.

GCC's libgomp and ``fork``: the child of a process that ran a parallel region inherits a team
whose threads it does not have. Callers therefore use OpenMP only in the process that loaded
the library (:func:`same_process`); a forked child falls back to the package's own pool.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

__all__ = ["LIBGOMP", "OPENMP_ENV", "runtime_function_address", "same_process",
           "torch_libgomp"]

#: The SONAME GCC's ``-fopenmp`` links against.
LIBGOMP = "libgomp.so.1"
#: Set to ``0`` to run the decode kernel's shares on the package's own pool, never on OpenMP.
OPENMP_ENV = "APP_CPU_DECODE_OPENMP"
_RUNTIME_PREFIXES = ("libgomp", "libiomp", "libomp")
_loaded_in = os.getpid()


def _loaded_openmp_runtimes() -> list[Path]:
    """The OpenMP runtime files mapped into this process (``/proc/self/maps``), in order."""
    found: list[Path] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                path = Path(fields[5].strip())
                if path.name.startswith(_RUNTIME_PREFIXES) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def torch_libgomp() -> tuple[Path | None, str]:
    """The ``libgomp.so.1`` torch loaded for its parallel ops, or ``None`` and why there is
    none (torch without OpenMP, another runtime such as ``libiomp5``, no ``/proc``)."""
    if not torch._C.has_openmp or "parallel backend: OpenMP" not in \
            torch.__config__.parallel_info():
        return None, "torch does not run its CPU ops on OpenMP"
    runtimes = _loaded_openmp_runtimes()
    for path in runtimes:
        if path.name == LIBGOMP:
            return path, ""
    names = ", ".join(p.name for p in runtimes) or "none found in /proc/self/maps"
    return None, f"torch's OpenMP runtime is not {LIBGOMP} ({names})"


def runtime_function_address(path: Path, name: str) -> int | None:
    """The address of ``name`` in the already loaded library ``path`` (never loads it)."""
    try:
        library = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        address: int | None = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return address


def same_process() -> bool:
    """False in a forked child of the process that imported this module (see the module)."""
    return os.getpid() == _loaded_in
