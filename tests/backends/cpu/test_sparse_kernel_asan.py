"""The native CPU sparse kernels (``csrc/mla_sparse_cpu.c``: attention over selected rows, the
indexer's scores, top-k) built with AddressSanitizer and UBSan and run by a C driver
(``native/asan_sparse_driver.c``) on shapes around every block-size, head-group, split and
item edge, each buffer allocated at exactly the size the kernel is told and NaN in every row
nothing names: an out-of-bounds read or write, or a read of a row that is not named, fails the
test. Skipped where the kernel cannot run (no AVX-512, no C compiler) or the compiler has no
sanitizers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from app.backends.cpu import loader, sparse_kernel
from tests._support import native_compiler_or_skip

#: builds and runs the kernel under AddressSanitizer: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("native") / "asan_sparse_driver.c"
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-mavx512f", "-mfma", "-mf16c"]


def test_sparse_kernels_are_memory_safe_and_correct_under_sanitizers(tmp_path: Path) -> None:
    compiler = native_compiler_or_skip()
    exe = tmp_path / "asan_sparse_driver"
    sources = [str(loader.NATIVE_DIR / s) for s in sparse_kernel.SPEC.sources]
    build = subprocess.run([compiler, *SANITIZE, "-I", str(loader.NATIVE_DIR), str(DRIVER),
                            *sources, "-o", str(exe), "-lm"],
                           capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "asan" in build.stderr.lower():
            pytest.skip(f"{compiler} cannot build with sanitizers: {build.stderr[-300:]}")
        pytest.fail(f"the kernel or driver did not compile:\n{build.stderr[-2000:]}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0"})  # the kernel allocates nothing
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.strip().endswith(" 0 bad"), run.stdout
