"""The native CPU indexer (``CpuSparseIndexer``): its selections equal ``TorchSparseIndexer``'s
exactly (ties at the k-th score, -1 padding, fewer candidates than k, causal prefill rows, several
requests), its scores equal the torch ones within float tolerance, a row holding a non-finite
score is ordered as ``topk_positions`` orders it, and the container picks it on the CPU."""

from __future__ import annotations

import pytest
import torch

from app._types import DeviceCapability
from app.backends.cpu import sparse_kernel
from app.backends.cpu.sparse_kernel import load_sparse_kernel
from app.backends.sparse import cpu_indexer
from app.backends.sparse.cpu_indexer import CpuSparseIndexer, default_sparse_indexer
from app.backends.sparse.indexer import (
    SparseIndexerMetadata,
    TorchSparseIndexer,
    topk_positions,
)
from app.containers import create_container
from app.platforms import CpuPlatform, CudaPlatform

needs_kernel = pytest.mark.skipif(not CpuSparseIndexer.is_available(),
                                  reason="the native CPU sparse kernel cannot run here")
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def _step(gen: torch.Generator, dtype: torch.dtype, query_lens: list[int], visible: list[int],
          *, heads: int = 8, dim: int = 64, bs: int = 16, integers: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SparseIndexerMetadata]:
    """A paged key cache (pages shuffled) and queries; ``integers``: small integers, whose
    products and sums are exact in float32 whatever their order, so scores tie exactly."""
    batch = len(query_lens)
    starts = [sum(query_lens[:b]) for b in range(batch)]
    seen = [max(visible[s:s + n]) for s, n in zip(starts, query_lens, strict=True)]
    width = max(-(-n // bs) for n in seen)
    blocks = batch * width + 3
    table = torch.randperm(blocks, generator=gen)[:batch * width].view(batch, width)
    rows = sum(query_lens)

    def draw(*shape: int) -> torch.Tensor:
        if integers:
            return torch.randint(-2, 3, shape, generator=gen).to(dtype)
        return torch.randn(*shape, generator=gen).to(dtype)

    cache = draw(blocks, bs, dim)
    q = draw(rows, heads, dim)
    w = (torch.randint(-1, 3, (rows, heads), generator=gen).float() if integers
         else torch.rand(rows, heads, generator=gen) - 0.3)
    return q, w, cache, SparseIndexerMetadata.build(table.to(torch.int32), query_lens, visible)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [1, 7, 64, 500])
def test_selections_equal_the_torch_indexer_exactly_with_ties(dtype: torch.dtype,
                                                              topk: int) -> None:
    gen = torch.Generator().manual_seed(topk)
    # decode rows of 4 requests (one sees 1 key, one fewer keys than most k), prefill rows
    q, w, cache, meta = _step(gen, dtype, [1, 1, 1, 5],
                              [1, 40, 300, 200, 201, 202, 203, 204])
    want = TorchSparseIndexer().select(q, w, cache, meta, topk)
    got = CpuSparseIndexer().select(q, w, cache, meta, topk)
    assert torch.equal(got, want)
    assert bool((got[0, 1:] == -1).all()) and int(got[0, 0]) == 0  # 1 candidate, k-1 padding


@needs_kernel
def test_a_prefill_of_causal_rows_selects_as_the_torch_indexer() -> None:
    gen = torch.Generator().manual_seed(3)
    n = 150
    q, w, cache, meta = _step(gen, torch.bfloat16, [n], list(range(1, n + 1)), bs=7)
    for topk in (16, 149, 150, 151):
        want = TorchSparseIndexer().select(q, w, cache, meta, topk)
        assert torch.equal(CpuSparseIndexer().select(q, w, cache, meta, topk), want)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_equal_the_torch_ones_within_float_tolerance(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    q, w, cache, meta = _step(gen, dtype, [2, 3], [90, 91, 60, 61, 62], heads=12, dim=128,
                              integers=False)
    kernel = load_sparse_kernel()
    assert kernel is not None
    scores = torch.full((5, 91), float("nan"))
    kernel.scores(q, w, cache, meta.block_table, meta.visible, [(0, 0, 2), (1, 2, 5)], scores, 0)
    for t, (b, vis) in enumerate(zip([0, 0, 1, 1, 1], meta.visible.tolist(), strict=True)):
        pos = torch.arange(vis)
        keys = cache[meta.block_table[b].long()[pos // cache.shape[1]], pos % cache.shape[1]]
        ref = (q[t].float() @ keys.float().t()).relu().mul(w[t].unsqueeze(1)).sum(0)
        torch.testing.assert_close(scores[t, :vis], ref, rtol=1e-4, atol=1e-3)
        # positions past what a row sees but within its block of rows: -inf, never a candidate
        seen = max(meta.visible.tolist()[:2]) if b == 0 else max(meta.visible.tolist()[2:])
        assert bool(torch.isneginf(scores[t, vis:seen]).all())


@needs_kernel
def test_a_row_with_a_non_finite_score_is_ordered_as_topk_positions_orders_it() -> None:
    kernel = load_sparse_kernel()
    assert kernel is not None
    scores = torch.tensor([[1.0, float("nan"), 3.0, 2.0, 0.5, 7.0],
                           [1.0, float("inf"), 3.0, 3.0, 3.0, 0.0],
                           [1.0, 2.0, 3.0, 3.0, 3.0, 0.0]])
    counts = torch.tensor([6, 6, 5])
    out = torch.full((3, 3), -1, dtype=torch.int32)
    kernel.topk(scores, counts, out)
    for r in range(3):
        n = int(counts[r])
        assert torch.equal(out[r], topk_positions(scores[r:r + 1, :n], 3)[0]), r
    assert out[2].tolist() == [2, 3, 4]  # the earliest of the tied, increasing


@needs_kernel
def test_a_float64_q_selects_as_the_torch_indexer() -> None:
    gen = torch.Generator().manual_seed(9)
    q, w, cache, meta = _step(gen, torch.float32, [2], [30, 31])
    want = TorchSparseIndexer().select(q.double(), w, cache, meta, 8)
    assert torch.equal(CpuSparseIndexer().select(q.double(), w, cache, meta, 8), want)


@needs_kernel
def test_minus_zero_and_zero_tie() -> None:
    kernel = load_sparse_kernel()
    assert kernel is not None
    scores = torch.tensor([[0.0, -0.0, 0.0, -1.0, -0.0]])
    out = torch.full((1, 2), -1, dtype=torch.int32)
    kernel.topk(scores, torch.tensor([5]), out)
    assert out.tolist() == topk_positions(scores, 2).tolist() == [[0, 1]]


@needs_kernel
def test_the_cpu_indexer_refuses_tensors_off_the_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    q, w, cache, meta = _step(gen, torch.float32, [1], [5])
    with pytest.raises(ValueError, match="expected CPU tensors"):
        CpuSparseIndexer()._select(q.to("meta"), w, cache, meta,
                                   torch.full((1, 2), -1, dtype=torch.int32))


def test_the_container_builds_the_cpu_indexer_on_the_cpu_where_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    container = create_container(platform=CpuPlatform())
    expected = CpuSparseIndexer if CpuSparseIndexer.is_available() else TorchSparseIndexer
    assert type(container.sparse_indexer()) is expected
    cuda = CudaPlatform(device_capability=DeviceCapability(9, 0))
    assert type(default_sparse_indexer(cuda)) is TorchSparseIndexer
    assert type(default_sparse_indexer(None)) is TorchSparseIndexer
    monkeypatch.setattr(CpuSparseIndexer, "probe", staticmethod(lambda: False))
    monkeypatch.setattr(cpu_indexer, "_told", cpu_indexer.threading.Event())
    assert type(default_sparse_indexer(CpuPlatform())) is TorchSparseIndexer


def test_switched_off_the_kernel_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_CPU_NATIVE_KERNEL", "0")
    status = sparse_kernel.load_native_library(
        sparse_kernel.NativeLibrarySpec(**{**_spec_fields(), "name": "mla_sparse_cpu_off"}))
    assert not status.available
    assert any("APP_CPU_NATIVE_KERNEL" in r for r in status.reasons)


def _spec_fields() -> dict[str, object]:
    spec = sparse_kernel.SPEC
    return {f: getattr(spec, f) for f in ("sources", "abi_version", "flags", "link_flags",
                                          "structs", "self_test", "requirements", "switches")}


@needs_kernel
@pytest.mark.parametrize("topk", [10**6, 2**31 - 1])
def test_a_top_k_past_every_context_is_only_as_wide_as_the_step_s_keys(topk: int) -> None:
    """Issue 44: as the torch indexer, ``min(topk, the most keys a row sees)`` wide."""
    gen = torch.Generator().manual_seed(11)
    q, w, cache, meta = _step(gen, torch.bfloat16, [1, 3], [9, 20, 21, 22])
    got = CpuSparseIndexer().select(q, w, cache, meta, topk)
    assert got.shape == (4, 22)
    assert torch.equal(got, TorchSparseIndexer().select(q, w, cache, meta, topk))
    assert torch.equal(got, CpuSparseIndexer().select(q, w, cache, meta, 22))
