"""The native CPU decode kernel built with AddressSanitizer and UBSan and run by a C driver
(``native/asan_decode_driver.c``) on shapes around every block-size, head-count, query-length
and split edge, each buffer allocated at exactly the size the kernel is told and NaN in the
unused rows of every last block: an out-of-bounds read or write, or a read past ``seq_len``,
fails the test. Then the hostile cases (``native/asan_decode_hostile.h``) on the FP8 caches
(fp8_e4m3, fp8_ds_mla; float and dot path) and a bf16 one: block ids at the edges and out of
range (refused, nothing written), table entries past the end, padded and byte-aligned rows,
NaN in keys and queries (exactly the rows that see them come out NaN), every e4m3 code,
fp8_ds_mla's scales at and past every edge, shared blocks and overlapping inputs; the driver
prints how many of each. Where the CPU lacks AVX-512 the kernel runs under SIMDe's emulation
(``_sanitizer``); skipped where neither can run (no C compiler, no SIMDe) or the compiler has
no sanitizers.

The AMX kernel (``csrc/mla_decode_amx.c``) goes through the same driver (its bf16 cases,
hostile ones included): always with its tiles emulated in C (which also counts every tile
operation the hardware would refuse), and with the real AMX instructions where the CPU has
them (elsewhere that build is compiled, not run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from app._cpu import cpu_flags
from app.backends.cpu import decode_kernel as cpu_mla_decode
from app.backends.cpu import decode_kernel_amx
from tests.backends.cpu._sanitizer import build_driver, run_driver

#: builds and runs the kernel under AddressSanitizer: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("native") / "asan_decode_driver.c"
ISA = ("-mavx512f", "-mfma", "-mf16c")
AMX_ISA = (*ISA, "-mavx512bw", "-mavx512vl")


def test_decode_kernel_is_memory_safe_and_correct_under_sanitizers(tmp_path: Path) -> None:
    exe, _ = build_driver(tmp_path, DRIVER, cpu_mla_decode.SPEC.sources, ISA, openmp=True)
    assert "decode hostile cases:" in run_driver(exe)


def test_amx_kernel_with_emulated_tiles_is_memory_safe_and_correct(tmp_path: Path) -> None:
    exe, _ = build_driver(tmp_path, DRIVER, decode_kernel_amx.SPEC_AMX.sources, AMX_ISA,
                          ["-DAPP_AMX_DRIVER", "-DAPP_AMX_EMULATE"], openmp=True)
    assert "AMX kernel (emulated tiles)" in run_driver(exe)


def test_amx_kernel_with_real_tiles_builds_and_runs_where_there_is_amx(tmp_path: Path) -> None:
    exe, _ = build_driver(tmp_path, DRIVER, decode_kernel_amx.SPEC_AMX.sources,
                          (*AMX_ISA, "-mamx-tile", "-mamx-bf16"), ["-DAPP_AMX_DRIVER"],
                          openmp=True, as_is=True)
    if not {"avx512f", "avx512bw", "avx512vl", "amx_tile", "amx_bf16"} <= cpu_flags():
        pytest.skip("built; not run: this CPU has no AMX tiles")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0"}, check=False)
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert "AMX kernel (AMX tiles)" in run.stdout and run.stdout.strip().endswith(" 0 bad")
