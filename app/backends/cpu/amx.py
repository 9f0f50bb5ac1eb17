"""Whether this process may run AMX tile instructions, and why not when it may not.

Three things must hold, checked in this order (:func:`amx_status`):

1. **The CPU has the tiles**: ``amx_tile`` and ``amx_bf16`` in ``/proc/cpuinfo``'s flags (the
   kernel lists them only when it manages the tile state), on Linux x86-64.
2. **The switch allows it**: ``APP_CPU_AMX=0`` keeps every AMX path of this package off (the
   AVX-512 ones run; see :data:`AMX_ENV` for what it covers).
3. **Linux granted the tile state to this process**: the 8 KiB of tile data are a dynamic
   xstate feature, handed out only on request, ``arch_prctl(ARCH_REQ_XCOMP_PERM,
   XFEATURE_XTILEDATA)`` (once per process, inherited by its threads and forked children);
   without it the first tile instruction kills the process with SIGILL. A seccomp profile
   can refuse the call (EPERM), a CPU or kernel without the feature answers EOPNOTSUPP /
   EINVAL, and a process whose signal alternate stacks are too small for the larger signal
   frame gets ENOSPC (faulthandler's stack, on old glibc). Each refusal is "not available",
   with the errno and what it means.

The request is made at most once per process (granted or refused, the answer is kept);
``syscall=`` replaces the system call in tests (faked refusals), and ``flags=`` the CPU's
flags.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from collections.abc import Callable

import attrs

from app.backends.cpu.loader import cpu_flags, read_switch

__all__ = ["AMX_ENV", "ARCH_GET_XCOMP_PERM", "ARCH_REQ_XCOMP_PERM", "XFEATURE_XTILEDATA",
           "AmxStatus", "amx_status", "amx_turned_off", "cpu_has_amx",
           "request_tile_permission"]

#: Set to ``0`` to keep every AMX path off (the AVX-512 paths run instead): CPU_MLA's AMX
#: kernel, and TORCH_SDPA's bf16 prefill on aten (oneDNN's AMX brgemm), which then takes the
#: native kernel, or aten in float32. torch's own bf16 matmuls elsewhere (a model's
#: projections) are oneDNN's to decide: ``ONEDNN_MAX_CPU_ISA`` caps them, read once by oneDNN.
AMX_ENV = "APP_CPU_AMX"
#: ``arch_prctl`` codes (``asm/prctl.h``) and the tile-data xstate feature number.
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
#: ``SYS_arch_prctl`` on x86-64.
_SYS_ARCH_PRCTL = 158

#: ``syscall(number, *args) -> (result, errno)``.
Syscall = Callable[..., "tuple[int, int]"]

_ERRNO_MEANING = {
    errno.EOPNOTSUPP: "this CPU or kernel has no AMX tile state to hand out",
    errno.EINVAL: "the kernel does not know the request (Linux < 5.16?)",
    errno.EPERM: "refused by a security policy (a seccomp profile, as containers often have)",
    errno.ENOSPC: ("a signal alternate stack in this process is too small for the larger "
                   "signal frame AMX needs"),
    errno.ENOSYS: "the kernel has no arch_prctl",
}


@attrs.frozen
class AmxStatus:
    """``available``: this process may run AMX tile instructions; ``reason``: why not (or,
    when available, what was checked)."""

    available: bool
    reason: str


def _libc_syscall(number: int, *args: object) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = int(libc.syscall(ctypes.c_long(number), *args))
    return result, ctypes.get_errno() if result < 0 else 0


_lock = threading.Lock()
_permission: list[str | None] = []  # [] not asked yet; [None] granted; [why] refused


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the permission itself is inherited: the answer stays valid


os.register_at_fork(after_in_child=_after_fork_in_child)


def request_tile_permission(syscall: Syscall | None = None) -> str | None:
    """Ask Linux for the AMX tile state (once per process): ``None`` when granted, else why
    not (the errno, its name and what it means here). ``syscall`` replaces the real call
    (tests); an answer from a replaced call is not kept."""
    if syscall is not None:
        return _ask(syscall)
    with _lock:
        if not _permission:
            _permission.append(_ask(_libc_syscall))
        return _permission[0]


def _ask(syscall: Syscall) -> str | None:
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the tile state is requested from Linux on x86-64; this is " \
               f"{platform.system()} {platform.machine()}"
    try:
        result, err = syscall(_SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError, TypeError) as exc:
        return f"could not call arch_prctl: {type(exc).__name__}: {exc}"
    if result == 0:
        return _check_granted(syscall)
    name = errno.errorcode.get(err, str(err))
    meaning = _ERRNO_MEANING.get(err, os.strerror(err) if err else "no errno")
    return (f"Linux refused the AMX tile state: arch_prctl(ARCH_REQ_XCOMP_PERM, "
            f"XFEATURE_XTILEDATA) failed with {name} ({meaning})")


def _check_granted(syscall: Syscall) -> str | None:
    """The permitted-features mask must now hold the tile data (ARCH_GET_XCOMP_PERM)."""
    mask = ctypes.c_uint64(0)
    try:
        result, err = syscall(_SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    except (OSError, AttributeError, TypeError) as exc:
        return f"could not read the granted xstate features: {type(exc).__name__}: {exc}"
    if result != 0:
        return (f"arch_prctl(ARCH_GET_XCOMP_PERM) failed with "
                f"{errno.errorcode.get(err, str(err))} after the request was granted")
    if not mask.value >> XFEATURE_XTILEDATA & 1:
        return (f"Linux accepted the request but the permitted xstate features "
                f"({mask.value:#x}) do not include the tile data (bit {XFEATURE_XTILEDATA})")
    return None


def amx_turned_off() -> bool:
    """``APP_CPU_AMX=0`` is set (read on every call; ``ValueError`` for a bad value)."""
    return not read_switch(AMX_ENV)


def cpu_has_amx(flags: frozenset[str] | None = None) -> bool:
    """The CPU reports AMX-BF16 tiles (``amx_tile`` and ``amx_bf16``; ``flags`` default to
    ``/proc/cpuinfo``'s), whether or not this process may use them."""
    return {"amx_tile", "amx_bf16"} <= (cpu_flags() if flags is None else flags)


def amx_status(flags: frozenset[str] | None = None, syscall: Syscall | None = None
               ) -> AmxStatus:
    """Whether this process may run AMX tile instructions (see the module docstring):
    ``flags`` default to the CPU's (``/proc/cpuinfo``), ``syscall`` to the real one. Raises
    ``ValueError`` for a bad ``APP_CPU_AMX`` value."""
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in ("amx_tile", "amx_bf16") if f not in flags]
    if missing:
        return AmxStatus(False, f"this CPU has no AMX-BF16 tiles ({' and '.join(missing)} "
                                f"not in /proc/cpuinfo's flags)")
    if not read_switch(AMX_ENV):
        return AmxStatus(False, f"turned off by {AMX_ENV}=0")
    refused = request_tile_permission(syscall)
    if refused is not None:
        return AmxStatus(False, refused)
    return AmxStatus(True, "amx_tile and amx_bf16 present; Linux granted the tile state")
