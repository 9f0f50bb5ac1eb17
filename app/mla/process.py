"""Process-level tuning for the command-line jobs (never applied by the library itself).

A CPU prefill step allocates and frees tensors of tens to hundreds of MiB. glibc's ``malloc``
serves blocks above its mmap threshold (at most 32 MiB) with fresh ``mmap`` calls and unmaps
them on free, so every step page-faults its working set in again: on the 2-core machines this
cost ~15% of the main job's time in kernel page-fault handling. Keeping large blocks in the heap
(``M_MMAP_MAX = 0``) and never trimming it (``M_TRIM_THRESHOLD``) lets freed memory be reused
without faults, as jemalloc / tcmalloc would. ``python -m app run`` and ``python -m app bench
run`` call ``tune_malloc_for_large_tensors()`` once at start-up; an embedding engine decides
for its own process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

__all__ = ["tune_malloc_for_large_tensors"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_NEVER = 2**31 - 1


def tune_malloc_for_large_tensors() -> bool:
    """Make glibc keep large freed blocks for reuse (no per-step page faults).

    Returns whether it was applied (False off Linux/glibc, or if ``mallopt`` refused). Affects
    the whole process: call it from a program's entry point, not from library code.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER))
    logger.debug("glibc malloc tuned for large tensors: %s", applied)
    return applied
