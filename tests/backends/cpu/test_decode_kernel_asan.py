"""The native CPU decode kernel built with AddressSanitizer and UBSan and run by a C driver
(``native/asan_decode_driver.c``) on shapes around every block-size, head-count, query-length
and split edge, each buffer allocated at exactly the size the kernel is told and NaN in the
unused rows of every last block: an out-of-bounds read or write, or a read past ``seq_len``,
fails the test. Skipped where the kernel cannot run (no AVX-512, no C compiler) or the
compiler has no sanitizers.

The AMX kernel (``csrc/mla_decode_amx.c``) goes through the same driver (its bf16 cases):
always with its tiles emulated in C (which also counts every tile operation the hardware
would refuse), and with the real AMX instructions where the CPU has them (elsewhere that
build is compiled, not run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from app.backends.cpu import decode_kernel as cpu_mla_decode
from app.backends.cpu import decode_kernel_amx
from app.backends.cpu import loader as loader
from app.backends.cpu.loader import cpu_flags
from tests._support import native_compiler_or_skip

#: builds and runs the kernel under AddressSanitizer: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("native") / "asan_decode_driver.c"
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-mavx512f", "-mfma", "-mf16c", "-fopenmp"]


def test_decode_kernel_is_memory_safe_and_correct_under_sanitizers(tmp_path: Path) -> None:
    compiler = native_compiler_or_skip()
    exe = tmp_path / "asan_decode_driver"
    sources = [str(loader.NATIVE_DIR / s) for s in cpu_mla_decode.SPEC.sources]
    build = subprocess.run([compiler, *SANITIZE, "-I", str(loader.NATIVE_DIR), str(DRIVER),
                            *sources, "-o", str(exe), "-lm", "-fopenmp"],
                           capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "asan" in build.stderr.lower():
            pytest.skip(f"{compiler} cannot build with sanitizers: {build.stderr[-300:]}")
        pytest.fail(f"the kernel or driver did not compile:\n{build.stderr[-2000:]}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0"})  # the kernel allocates nothing
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.strip().endswith(" 0 bad"), run.stdout


AMX_FLAGS = ["-mavx512bw", "-mavx512vl", "-DAPP_AMX_DRIVER"]


def _build_amx_driver(tmp_path: Path, variant: list[str]) -> Path:
    compiler = native_compiler_or_skip()
    exe = tmp_path / "asan_decode_driver_amx"
    sources = [str(loader.NATIVE_DIR / s) for s in decode_kernel_amx.SPEC_AMX.sources]
    build = subprocess.run([compiler, *SANITIZE, *AMX_FLAGS, *variant, "-I",
                            str(loader.NATIVE_DIR), str(DRIVER), *sources, "-o", str(exe),
                            "-lm", "-fopenmp"], capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "asan" in build.stderr.lower():
            pytest.skip(f"{compiler} cannot build with sanitizers: {build.stderr[-300:]}")
        if "amx" in build.stderr.lower() and "-mamx-tile" in variant:
            pytest.skip(f"{compiler} does not know AMX: {build.stderr[-300:]}")
        pytest.fail(f"the AMX kernel or driver did not compile:\n{build.stderr[-2000:]}")
    return exe


def _run_driver(exe: Path) -> str:
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0"})
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.strip().endswith(" 0 bad"), run.stdout
    return run.stdout


def test_amx_kernel_with_emulated_tiles_is_memory_safe_and_correct(tmp_path: Path) -> None:
    if not {"avx512f", "avx512bw"} <= cpu_flags():
        pytest.skip("the AMX source's AVX-512 parts need AVX512BW")
    out = _run_driver(_build_amx_driver(tmp_path, ["-DAPP_AMX_EMULATE"]))
    assert "AMX kernel (emulated tiles)" in out


def test_amx_kernel_with_real_tiles_builds_and_runs_where_there_is_amx(tmp_path: Path) -> None:
    exe = _build_amx_driver(tmp_path, ["-mamx-tile", "-mamx-bf16"])
    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        pytest.skip("built; not run: this CPU has no AMX tiles")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0"})
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert "AMX kernel (AMX tiles)" in run.stdout and run.stdout.strip().endswith(" 0 bad")
