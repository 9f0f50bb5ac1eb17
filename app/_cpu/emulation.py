"""AVX-512 emulated by SIMDe, for testing only: ``APP_CPU_EMULATE_AVX512=1``.

The native CPU kernels are AVX-512 code. On an x86-64 CPU without AVX-512 (an AVX2 EPYC, a
laptop) they cannot run, so neither can the tests that drive them in-process. With this switch
set, the native loader builds every library whose flags ask for ``-mavx512*`` for AVX2 instead
(``-mavx2 -mfma -mf16c``), with ``app_avx512_emulation.h`` force-included: SIMDe
(https://github.com/simd-everywhere/simde) gives every AVX-512 intrinsic its meaning in
portable code, and the header adds what SIMDe lacks and takes every run-time ``avx512*``
branch. The CPU's features then read as having the emulated extensions
(:data:`EMULATED_FLAGS`), so the backends built on those kernels are available and their
tests run: several times slower than real AVX-512, and never for serving (``platform`` says
EMULATED on every line it concerns).

It takes effect only on an x86-64 CPU without AVX-512F of its own, with AVX2, FMA and F16C,
where a C compiler finds SIMDe's headers: on its default include path (Debian:
``apt-get install libsimde-dev``) or in the folder ``APP_SIMDE_INCLUDE`` names (the folder
holding ``simde/``; it must pass the trust check of :func:`app._files.trusted_tree_problem`,
since what it holds is compiled into code this process loads). Where it cannot, it changes
nothing and :func:`decide` says why (``platform`` prints it). AMX builds (``-mamx-*``) are
never emulated. The loader's own check that the CPU can run a library's instructions keeps
reading the real CPU, so only an emulated build passes it here.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import attrs

from app._files import trusted_tree_problem

__all__ = ["EMULATED_FLAGS", "EMULATE_ENV", "EMULATION_HEADER", "HOST_FLAGS", "SIMDE_INCLUDE_ENV",
           "Avx512Emulation", "decide", "emulated_build_flags", "find_compiler", "simde_version"]

#: The switch: 1/true/on/yes turns the emulation on (when it can take effect), unset or
#: 0/false/off/no leaves it off.
EMULATE_ENV = "APP_CPU_EMULATE_AVX512"
#: A folder holding ``simde/``, searched before the compiler's own include path.
SIMDE_INCLUDE_ENV = "APP_SIMDE_INCLUDE"
#: The header force-included into an emulated build (in the kernels' source folder).
EMULATION_HEADER = "app_avx512_emulation.h"
#: What the emulated build needs of the CPU itself.
HOST_FLAGS = frozenset({"avx2", "fma", "f16c"})
#: The ``/proc/cpuinfo`` flags of the AVX-512 extensions the emulation provides.
EMULATED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                            "avx512_bf16", "avx512vbmi"})
_HOST_ISA = ("-mavx2", "-mfma", "-mf16c")
_ON = {"1": True, "true": True, "on": True, "yes": True,
       "": False, "0": False, "false": False, "off": False, "no": False}
_VERSION = re.compile(r"#define SIMDE_VERSION_(MAJOR|MINOR|MICRO) (\d+)")


def find_compiler() -> str | None:
    """``$CC``, else the first of cc/gcc/clang on ``PATH``; ``None`` if none is found."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


@attrs.frozen
class Avx512Emulation:
    """Whether AVX-512 is emulated in this process, and why (not).

    ``requested``: ``APP_CPU_EMULATE_AVX512`` is set to anything but off; ``active``: the
    emulation is in effect; ``reason``: what it does, or why it does not take effect;
    ``include``: the ``-I`` flags that find SIMDe (``APP_SIMDE_INCLUDE``'s folder, or none);
    ``simde_version``: SIMDe's, as the compiler finds it (``"0.7.4"``)."""

    requested: bool
    active: bool
    reason: str
    include: tuple[str, ...] = ()
    simde_version: str = ""

    @property
    def simde(self) -> str:
        """Which SIMDe: ``"SIMDe 0.7.4 (the compiler's include path)"``."""
        where = (f"{SIMDE_INCLUDE_ENV}={self.include[-1]}" if self.include
                 else "the compiler's include path")
        return f"SIMDe {self.simde_version} ({where})"

    def line(self) -> str:
        """One line for ``platform``: ``EMULATED by SIMDe ...``, or why it is not in effect."""
        if self.active:
            return f"EMULATED by {self.simde}: {self.reason}"
        return self.reason


_OFF = Avx512Emulation(False, False, f"off ({EMULATE_ENV} unset or off)")


def decide(real_flags: frozenset[str]) -> Avx512Emulation:
    """Whether the emulation takes effect on a CPU with the ``/proc/cpuinfo`` flags
    ``real_flags`` under the environment as it is now (read every call; the compiler probe is
    made once per compiler and folder)."""
    raw = os.environ.get(EMULATE_ENV, "")
    if _ON.get(raw.strip().lower()) is False:  # off: no compiler looked for, nothing probed
        return _OFF
    relevant = real_flags & (HOST_FLAGS | {"avx512f"})
    return _decide(raw, os.environ.get(SIMDE_INCLUDE_ENV, ""), relevant, find_compiler(),
                   platform.machine().lower())


@functools.lru_cache(maxsize=16)
def _decide(raw: str, folder: str, flags: frozenset[str], compiler: str | None,
            machine: str) -> Avx512Emulation:
    on = _ON.get(raw.strip().lower())
    if on is None:
        return _refused(f"{EMULATE_ENV}={raw!r} is not one of 1/true/on/yes or 0/false/off/no")
    if not on:
        return _OFF
    if machine not in ("x86_64", "amd64"):
        return _refused(f"needs an x86-64 CPU, this is {machine}")
    if "avx512f" in flags:
        return _refused("this CPU has AVX-512 (avx512f) itself: the real kernels run")
    if not flags >= HOST_FLAGS:
        return _refused(f"the emulated build needs {', '.join(sorted(HOST_FLAGS))}; this CPU "
                        f"lacks {', '.join(sorted(HOST_FLAGS - flags))}")
    include: tuple[str, ...] = ()
    if folder:
        problem = trusted_tree_problem(folder)
        if problem is not None:
            return _refused(f"{SIMDE_INCLUDE_ENV}={folder} is not trusted: {problem}")
        if not os.path.isdir(os.path.join(folder, "simde")):
            return _refused(f"{SIMDE_INCLUDE_ENV}={folder} holds no simde/ folder")
        include = ("-I", os.path.realpath(folder))
    if compiler is None:
        return _refused("needs a C compiler (set CC, or install cc/gcc/clang)")
    simde, problem = simde_version(compiler, include)
    if problem is not None:
        return _refused(problem)
    return Avx512Emulation(True, True, f"{EMULATE_ENV}=1: the native kernels' AVX-512 runs "
                           f"as portable AVX2 code, for testing only (several times slower; "
                           f"never for serving)", include, simde)


def _refused(why: str) -> Avx512Emulation:
    return Avx512Emulation(True, False, f"{EMULATE_ENV} is set but not in effect: {why}")


def simde_version(compiler: str, include: tuple[str, ...]) -> tuple[str, str | None]:
    """SIMDe's version as ``compiler`` finds it (``"0.7.4"``), and why it cannot be used (None
    where it can)."""
    probe = "#include <simde/x86/avx512.h>\n#include <simde/x86/f16c.h>\n"
    try:
        proc = subprocess.run([compiler, *include, *_HOST_ISA, "-E", "-dM", "-x", "c", "-"],
                              input=probe, capture_output=True, text=True, timeout=120,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"{compiler} could not be run: {exc}"
    if proc.returncode != 0:
        return "", (f"{compiler} does not find SIMDe's headers (apt-get install libsimde-dev, "
                    f"or {SIMDE_INCLUDE_ENV}=<folder holding simde/>): "
                    f"{proc.stderr.strip()[-300:]}")
    parts = dict(_VERSION.findall(proc.stdout))
    return ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "MICRO")), None


def emulated_build_flags(flags: Sequence[str], emulation: Avx512Emulation,
                         header: Path) -> tuple[tuple[str, ...], str | None]:
    """The compiler flags to build a library made with ``flags`` under ``emulation``, and a
    note for its status (None: nothing to say). A library with no ``-mavx512*`` flag keeps its
    flags, with no note. With the emulation in effect, the ``-mavx512*`` flags give way to
    ``-mavx2 -mfma -mf16c``, ``header`` (an absolute path: never one from the working
    directory) is force-included and SIMDe's folder searched; every other flag is kept, and
    ``-DAPP_SIMDE_VERSION`` makes a build with another SIMDe another cache file. An AMX build
    (``-mamx-*``) keeps its flags: the loader refuses it on a CPU without them."""
    if not any(f.startswith("-mavx512") for f in flags) or not emulation.requested:
        return tuple(flags), None
    if not emulation.active:
        return tuple(flags), emulation.reason
    if any(f.startswith("-mamx") for f in flags):
        return tuple(flags), f"not emulated: {EMULATE_ENV} does not cover AMX (-mamx-*) builds"
    kept = [f for f in flags if not f.startswith("-mavx512") and f not in _HOST_ISA]
    return ((*kept, *_HOST_ISA, "-Wno-psabi", f"-DAPP_SIMDE_VERSION={emulation.simde_version}",
             *emulation.include, "-include", str(header.resolve())),
            f"AVX-512 EMULATED ({EMULATE_ENV}=1, {emulation.simde}): for testing only, "
            f"several times slower")
