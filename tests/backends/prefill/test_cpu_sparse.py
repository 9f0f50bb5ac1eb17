"""CPU_MLA_SPARSE prefill: the sparse prefill kit (context chunks merged by LSE included) on the
native kernel, and its dimension checks."""

from __future__ import annotations

import pytest
import torch

from app._types import MLADimensions
from app.backends.prefill.cpu_sparse import CpuSparsePrefillBackend
from app.testing import SPARSE_PREFILL_CASES, run_conformance

needs_kernel = pytest.mark.skipif(not CpuSparsePrefillBackend.is_available(),
                                  reason="the native CPU sparse kernel cannot run here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_sparse_prefill_passes_the_sparse_cases(dtype: torch.dtype) -> None:
    report = run_conformance(CpuSparsePrefillBackend, dtype=dtype)
    assert report.passed, report.format()
    assert [c.name for c in report.cases] == list(SPARSE_PREFILL_CASES)


def test_dimensions_it_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        CpuSparsePrefillBackend(4, 0.1, 96, 128, 64, 128)
    assert not CpuSparsePrefillBackend.supports_mla_dimensions(
        MLADimensions(kv_lora_rank=512, qk_rope_head_dim=48))
    assert CpuSparsePrefillBackend.supports_mla_dimensions(
        MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64))
