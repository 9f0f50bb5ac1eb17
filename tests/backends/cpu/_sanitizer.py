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

import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from app._cpu import real_cpu_flags, required_cpu_flags
from app._cpu.emulation import (
    EMULATION_HEADER,
    HOST_FLAGS,
    SIMDE_INCLUDE_ENV,
    Avx512Emulation,
    emulated_build_flags,
    simde_version,
)
from app._files import trusted_tree_problem
from app.backends.cpu import loader

SANITIZE = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer")


def simde_include_flags() -> list[str]:
    """``-I`` for the folder ``APP_SIMDE_INCLUDE`` names (none where it is unset); skips where
    that folder fails the trust check of anything the package compiles."""
    folder = os.environ.get(SIMDE_INCLUDE_ENV, "")
    if not folder:
        return []
    problem = trusted_tree_problem(folder)
    if problem is not None:
        pytest.skip(f"{SIMDE_INCLUDE_ENV}={folder}: {problem}")
    return ["-I", folder]


def isa_flags_or_skip(compiler: str, isa: Sequence[str]) -> tuple[list[str], bool]:
    """The flags that build a kernel made for the ISA flags ``isa`` (``-mavx512f``, ...) so it
    runs here, and whether that build is the emulated one. Skips where it cannot run at all.
    Unlike ``APP_CPU_EMULATE_AVX512``, a CPU with AVX-512 but not every extension ``isa``
    names (AVX512-BF16, say) builds emulated too: the driver's every branch runs."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the native kernels are x86-64 code")
    have = real_cpu_flags()  # never the flags APP_CPU_EMULATE_AVX512 adds
    missing = sorted(required_cpu_flags(isa) - have)
    if not missing:
        return list(isa), False
    if not have >= HOST_FLAGS:
        pytest.skip(f"this CPU lacks {missing}, and the AVX-512 emulation needs "
                    f"{sorted(HOST_FLAGS - have)} too")
    include = tuple(simde_include_flags())
    version, problem = simde_version(compiler, include)
    if problem is not None:
        pytest.skip(f"this CPU lacks {missing} and {problem}")
    emulation = Avx512Emulation(True, True, "sanitizer drivers", include, version)
    flags, _ = emulated_build_flags(isa, emulation, loader.NATIVE_DIR / EMULATION_HEADER)
    return list(flags), True


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
