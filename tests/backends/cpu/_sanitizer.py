"""Build a native kernel's C driver with AddressSanitizer and UBSan and run it.

The kernel is compiled with its own instruction sets where this CPU has them all. Where it
lacks some AVX-512 extension, the same sources are compiled for AVX2 with SIMDe's AVX-512
emulation force-included (``csrc/app_avx512_emulation.h``): every intrinsic keeps its meaning,
masked loads and stores touch only their lanes, and every run-time ``avx512*`` branch is
taken, so the drivers' memory-safety and hostile-input cases run on every x86-64 machine with
AVX2, FMA and F16C. SIMDe's headers come from the compiler's include path (Debian:
``apt-get install libsimde-dev``) or from the folder ``APP_SIMDE_INCLUDE`` names (one that holds
``simde/``); where neither has them, the test skips saying so.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from app._cpu import real_cpu_flags, required_cpu_flags
from app._files import trusted_tree_problem
from app.backends.cpu import loader

SANITIZE = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer")

#: What the emulated build needs of the CPU itself.
EMULATION_HOST = frozenset({"avx2", "fma", "f16c"})
EMULATION_HEADER = "app_avx512_emulation.h"


def simde_include_flags() -> list[str]:
    """``-I`` for the folder ``APP_SIMDE_INCLUDE`` names (none where it is unset); skips where
    that folder fails the trust check of anything the package compiles."""
    folder = os.environ.get("APP_SIMDE_INCLUDE", "")
    if not folder:
        return []
    problem = trusted_tree_problem(folder)
    if problem is not None:
        pytest.skip(f"APP_SIMDE_INCLUDE={folder}: {problem}")
    return ["-I", folder]


@functools.lru_cache(maxsize=4)
def _simde_problem(compiler: str, include: tuple[str, ...]) -> str | None:
    probe = "#include <simde/x86/avx512.h>\nint main(void) { return 0; }\n"
    proc = subprocess.run([compiler, *include, "-mavx2", "-fsyntax-only", "-x", "c", "-"],
                          input=probe, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode == 0:
        return None
    return (f"SIMDe's headers are not on {compiler}'s include path (apt-get install "
            f"libsimde-dev, or APP_SIMDE_INCLUDE=<folder holding simde/>): "
            f"{proc.stderr.strip()[-200:]}")


def isa_flags_or_skip(compiler: str, isa: Sequence[str]) -> tuple[list[str], bool]:
    """The flags that build a kernel made for the ISA flags ``isa`` (``-mavx512f``, ...) so it
    runs here, and whether that build is the emulated one. Skips where it cannot run at all."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the native kernels are x86-64 code")
    have = real_cpu_flags()  # never the flags APP_CPU_EMULATE_AVX512 adds
    if required_cpu_flags(isa) <= have:
        return list(isa), False
    if not have >= EMULATION_HOST:
        pytest.skip(f"this CPU lacks {sorted(required_cpu_flags(isa) - have)}, and the "
                    f"AVX-512 emulation needs {sorted(EMULATION_HOST - have)} too")
    problem = _simde_problem(compiler, tuple(simde_include_flags()))
    if problem is not None:
        pytest.skip(f"this CPU lacks {sorted(required_cpu_flags(isa) - have)} and {problem}")
    kept = [f for f in isa if not f.startswith("-mavx512")]
    return [*simde_include_flags(), *kept, "-mavx2", "-mfma", "-mf16c",
            "-include", str(loader.NATIVE_DIR / EMULATION_HEADER)], True


def build_driver(tmp_path: Path, driver: Path, sources: Sequence[str], isa: Sequence[str],
                 extra: Sequence[str] = (), *, openmp: bool = False, name: str = "driver",
                 as_is: bool = False) -> tuple[Path, bool]:
    """Compile ``driver`` with the kernel ``sources`` (file names under the native folder)
    under the sanitizers; the executable and whether its AVX-512 is emulated (``as_is``:
    never; the build may then not run here). Skips where the compiler has no sanitizers;
    fails where the code does not compile."""
    compiler = loader.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    flags, emulated = (list(isa), False) if as_is else isa_flags_or_skip(compiler, isa)
    exe = tmp_path / name
    omp = ["-fopenmp"] if openmp else []
    cmd = [compiler, *SANITIZE, *flags, *extra, *omp, "-I", str(loader.NATIVE_DIR), str(driver),
           *(str(loader.NATIVE_DIR / s) for s in sources), "-o", str(exe), "-lm", *omp]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "asan" in build.stderr.lower():
            pytest.skip(f"{compiler} cannot build with sanitizers: {build.stderr[-300:]}")
        pytest.fail(f"the kernel or driver did not compile:\n{' '.join(cmd)}\n"
                    f"{build.stderr[-3000:]}")
    return exe, emulated


def run_driver(exe: Path, *, timeout: int = 900) -> str:
    """Run a driver; its output, after checking it exited cleanly and reported ``0 bad``."""
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout,
                         env={"ASAN_OPTIONS": "detect_leaks=0"},  # the kernels allocate nothing
                         check=False)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.strip().endswith(" 0 bad"), run.stdout
    return run.stdout
