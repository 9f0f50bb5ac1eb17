"""Helpers several test packages share: the skip for tests that build and run the native CPU
kernels, and which GPU kernel packages a fresh interpreter ends up importing."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys
from collections.abc import Sequence

import pytest

from app._cpu import avx512_emulation, real_cpu_flags, required_cpu_flags
from app._cpu.emulation import EMULATION_HEADER, emulated_build_flags
from app.backends.cpu import loader, prefill_kernel

#: The GPU kernel packages that must stay unimported where they are not needed.
KERNEL_PACKAGES = ("flashinfer", "tokenspeed_mla", "flash_attn")


def native_compiler_or_skip() -> str:
    """The C compiler for a test that runs a native kernel the loader builds; skips the test
    where the kernel cannot run (not x86-64, no AVX-512, real or emulated, no C compiler). A
    test that compiles C code itself takes its flags from :func:`own_build_flags`."""
    compiler = loader.find_compiler()
    if compiler is None or platform.machine().lower() not in ("x86_64", "amd64") \
            or not prefill_kernel._cpu_has_avx512():
        pytest.skip("the native kernel cannot run here (needs x86-64, AVX-512, a C compiler)")
    return compiler


def own_build_flags(flags: Sequence[str], *, emulable: bool = True) -> list[str]:
    """The flags a test compiles its own C code with (a harness, a library of its own) when
    the code is made for ``flags`` (``-mavx512f``, ...): ``flags`` themselves where this CPU
    has every instruction set they name (read from the CPU itself), the emulated build's under
    ``APP_CPU_EMULATE_AVX512`` (in effect) unless ``emulable`` is False (code that picks its
    instructions itself: its own ``target`` attributes or CPU checks, which the emulation
    header cannot reach); otherwise the test skips: the code would die with SIGILL here."""
    missing = required_cpu_flags(flags) - real_cpu_flags()
    if not missing:
        return list(flags)
    emulation = avx512_emulation()
    if not emulable:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}, and this code picks its "
                    f"instructions itself (no AVX-512 emulation for it)")
    built, _ = emulated_build_flags(flags, emulation, loader.NATIVE_DIR / EMULATION_HEADER)
    if required_cpu_flags(built) <= real_cpu_flags():
        return list(built)
    pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} (AVX-512 emulation: "
                f"{emulation.line()})")


def kernel_packages_imported_by(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the ``KERNEL_PACKAGES`` it left imported."""
    probe = f"\nimport sys\nprint([m for m in {KERNEL_PACKAGES!r} if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code + probe], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    found: list[str] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    return found
