"""CPU_MLA_SPARSE decode: the sparse decode kit on the native kernel (both paths for bf16), equal
to TORCH_SPARSE on a V3.2-sized step, split rows merged by LSE, and the fall back to
TORCH_SPARSE where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch

from app.backends import explain_mla_decode_selection, get_mla_decode_backend
from app.backends.cpu.sparse_kernel import load_sparse_kernel
from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.decode.torch_sparse import TorchSparseDecodeBackend
from app.config import EngineConfig, ModelConfig
from app.containers import create_container, use_container
from app.platforms import CpuPlatform
from app.testing import SPARSE_DECODE_CASES, run_decode_conformance

needs_kernel = pytest.mark.skipif(not CpuSparseDecodeBackend.is_available(),
                                  reason="the native CPU sparse kernel cannot run here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_sparse_decode_passes_the_sparse_cases(dtype: torch.dtype) -> None:
    report = run_decode_conformance(CpuSparseDecodeBackend, dtype=dtype, num_heads=8)
    assert report.passed, report.format()
    assert [c.name for c in report.cases] == list(SPARSE_DECODE_CASES)


@needs_kernel
def test_the_float32_path_of_a_bf16_cache_passes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_CPU_DECODE_BF16_DOT", "0")
    report = run_decode_conformance(CpuSparseDecodeBackend, dtype=torch.bfloat16, num_heads=20,
                                    cases=["sparse_paged", "sparse_repeats_padding"])
    assert report.passed, report.format()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_equals_torch_sparse_on_a_v32_step(threads: int) -> None:
    """16 heads of 512 + 64, topk 2048 over 3000-token requests; 3 threads over 2 rows split
    each row's entries into parts merged by LSE."""
    gen = torch.Generator().manual_seed(threads)
    batch, seq, bs, heads, topk = 2, 3000, 64, 16, 2048
    per = -(-seq // bs)
    table = torch.randperm(batch * per, generator=gen).to(torch.int32).view(batch, per)
    cache = torch.randn(batch * per, bs, 576, generator=gen).bfloat16()
    q = torch.randn(batch, 1, heads, 576, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(batch * per * bs, generator=gen)[:topk]
                       for _ in range(batch)]).to(torch.int32).view(batch, 1, topk)
    idx[0, 0, 100:300] = -1
    meta = MLADecodeMetadata.build(table, torch.full((batch,), seq, dtype=torch.int32), 1)
    results = []
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for cls in (CpuSparseDecodeBackend, TorchSparseDecodeBackend):
            be = cls(heads, 0.07, 512, 64, torch.bfloat16)
            be.prepare_metadata(meta)
            results.append(be.run_sparse_decode(q, cache, idx, return_softmax_lse=True))
    finally:
        torch.set_num_threads(old)
    (out, lse), (ref, ref_lse) = results
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_run() -> None:
    kernel = load_sparse_kernel()
    assert kernel is not None
    q, kv = torch.randn(1, 2, 72), torch.randn(4, 72)  # head dim 72: not a multiple of 32
    with pytest.raises(ValueError, match="refused the attention"):
        kernel.attend(q, kv, 1, torch.zeros(1, 2, dtype=torch.int32), 64, torch.empty(1, 2, 64),
                      None, 0.1, 1.0)


def test_dimensions_it_cannot_run_are_refused_and_selection_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        CpuSparseDecodeBackend(4, 0.1, 96, 64, torch.bfloat16)
    config = EngineConfig(model=ModelConfig(index_topk=64))
    monkeypatch.setattr(CpuSparseDecodeBackend, "probe", staticmethod(lambda: False))
    with use_container(create_container(config, CpuPlatform())):
        assert get_mla_decode_backend(config) is TorchSparseDecodeBackend
        verdict = explain_mla_decode_selection(config)["backends"]["CPU_MLA_SPARSE"]
        assert not verdict["valid"]
        assert any("native CPU sparse kernel unavailable" in r for r in verdict["reasons"])
