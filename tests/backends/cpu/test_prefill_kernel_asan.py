"""The native CPU kernel built with AddressSanitizer and UBSan and run by a C driver
(``native/asan_driver.c``) on shapes around every tile, block and head-dim edge, each tensor
and the scratch allocated at exactly the size the kernel is told: an out-of-bounds read or
write fails the test, not only a wrong result. Both builds: float32 math, and bf16 products.
Where the CPU lacks the AVX-512 extensions a build needs, it runs under SIMDe's emulation
(``_sanitizer``); skipped where neither can run (no C compiler, no SIMDe) or the compiler has
no sanitizers."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.backends.cpu import prefill_kernel as native
from tests.backends.cpu._sanitizer import build_driver, run_driver

#: builds and runs the kernel under AddressSanitizer: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("native") / "asan_driver.c"
ISA = ("-mavx512f", "-mfma", "-mf16c")

#: The bf16-products build (``prefill_kernel_bf16.SPEC_BF16``): the same source, its bf16 tiles.
BF16_BUILD = ("-mavx512bf16", "-mavx512bw", "-mavx512vl", "-DMLA_PREFILL_BF16")


@pytest.mark.parametrize("build", ["float32", "bf16"])
def test_kernel_is_memory_safe_and_correct_under_sanitizers(tmp_path: Path, build: str) -> None:
    isa = (*ISA, *BF16_BUILD) if build == "bf16" else ISA
    exe, _ = build_driver(tmp_path, DRIVER, native.SPEC.sources, isa)
    run_driver(exe)
