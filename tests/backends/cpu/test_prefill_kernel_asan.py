"""The native CPU kernel built with AddressSanitizer and UBSan and run by a C driver
(``native/asan_driver.c``) on shapes around every tile, block and head-dim edge, each tensor
and the scratch allocated at exactly the size the kernel is told: an out-of-bounds read or
write fails the test, not only a wrong result. Both builds: float32 math, and bf16 products
(AVX512-BF16 CPUs only). Skipped where the kernel cannot run (no AVX-512, no C compiler) or the
compiler has no sanitizers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from app.backends.cpu import loader as loader
from app.backends.cpu import prefill_kernel as native
from app.platforms import detect_cpu_features
from tests._support import native_compiler_or_skip

#: builds and runs the kernel under AddressSanitizer: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("native") / "asan_driver.c"
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-mavx512f", "-mfma", "-mf16c"]


#: The bf16-products build (``_cpu_native_bf16.SPEC_BF16``): the same source, its bf16 tiles.
BF16_BUILD = ["-mavx512bf16", "-mavx512bw", "-mavx512vl", "-DMLA_PREFILL_BF16"]


@pytest.mark.parametrize("build", ["float32", "bf16"])
def test_kernel_is_memory_safe_and_correct_under_sanitizers(tmp_path: Path, build: str) -> None:
    compiler = native_compiler_or_skip()
    if build == "bf16" and not detect_cpu_features().avx512_bf16:
        pytest.skip("the bf16-products build needs a CPU with AVX512-BF16; this one has none")
    exe = tmp_path / "asan_driver"
    sources = [str(loader.NATIVE_DIR / s) for s in native.SPEC.sources]
    extra = BF16_BUILD if build == "bf16" else []
    build_proc = subprocess.run([compiler, *SANITIZE, *extra, "-I", str(loader.NATIVE_DIR),
                                 str(DRIVER),
                                 *sources, "-o", str(exe), "-lm"],
                                capture_output=True, text=True, timeout=120)
    if build_proc.returncode != 0:
        if "sanitize" in build_proc.stderr or "asan" in build_proc.stderr.lower():
            pytest.skip(f"{compiler} cannot build with sanitizers: {build_proc.stderr[-300:]}")
        pytest.fail(f"the kernel or driver did not compile:\n{build_proc.stderr[-2000:]}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0"})  # the kernel allocates nothing
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.strip().endswith("0 bad"), run.stdout
