"""Helpers several test packages share: the skip for tests that build and run the native CPU
kernels, and which GPU kernel packages a fresh interpreter ends up importing."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys

import pytest

from app.backends.cpu import loader, prefill_kernel

#: The GPU kernel packages that must stay unimported where they are not needed.
KERNEL_PACKAGES = ("flashinfer", "tokenspeed_mla", "flash_attn")


def native_compiler_or_skip() -> str:
    """The C compiler for a test that builds and runs a native kernel; skips the test where the
    kernel cannot run (not x86-64, no AVX-512, no C compiler)."""
    compiler = loader.find_compiler()
    if compiler is None or platform.machine().lower() not in ("x86_64", "amd64") \
            or not prefill_kernel._cpu_has_avx512():
        pytest.skip("the native kernel cannot run here (needs x86-64, AVX-512, a C compiler)")
    return compiler


def kernel_packages_imported_by(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the ``KERNEL_PACKAGES`` it left imported."""
    probe = f"\nimport sys\nprint([m for m in {KERNEL_PACKAGES!r} if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code + probe], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    found: list[str] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    return found
