"""The native CPU sparse kernels (``csrc/mla_sparse_cpu.c``: attention over selected rows;
``csrc/mla_sparse_index_cpu.c``: the indexer's scores, top-k) built with AddressSanitizer and
UBSan and run by a C driver (``native/asan_sparse_driver.c``) on shapes around every
block-size, head-group, split and item edge, each buffer allocated at exactly the size the
kernel is told and NaN in every row nothing names: an out-of-bounds read or write, or a read of
a row that is not named, fails the test. Then the hostile cases
(``native/asan_sparse_hostile.h``): indices at the edges, repeated and out of range (refused,
nothing written), -1 anywhere, NaN rows and queries (exactly the rows that read them come out
NaN), inputs overlapping and outputs placed against them; the driver prints how many of each.
Where the CPU lacks AVX-512 the kernel runs under SIMDe's emulation (``_sanitizer``); skipped
where neither can run (no C compiler, no SIMDe) or the compiler has no sanitizers."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.backends.cpu import sparse_kernel
from tests.backends.cpu._sanitizer import build_driver, run_driver

#: builds and runs the kernel under AddressSanitizer: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("native") / "asan_sparse_driver.c"
ISA = ("-mavx512f", "-mfma", "-mf16c")


def test_sparse_kernels_are_memory_safe_and_correct_under_sanitizers(tmp_path: Path) -> None:
    exe, _ = build_driver(tmp_path, DRIVER, sparse_kernel.SPEC.sources, ISA)
    assert "sparse attention, indexer and top-k hostile cases:" in run_driver(exe)
