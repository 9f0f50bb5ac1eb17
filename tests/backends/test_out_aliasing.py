"""Issue 44, the crash: every tensor a kernel reads is an aliasing hazard for ``out=``, integer
ones included, and the integer inputs a kernel reads are the checked private copies, never the
caller's tensors (which another thread may rewrite during a call).

The base-level rules are shown with plain-torch backends whose hook clears ``out`` before it
reads its inputs, or rewrites the caller's tensor between the check and the read (what another
thread may do), so a base that broke a rule gives a wrong answer or an out-of-range index. The
native backends (CPU_MLA_SPARSE, CPU_MLA) get the same hostile calls where they run (AVX-512)."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.decode.torch_sparse import TorchSparseDecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.backends.prefill.cpu_sparse import CpuSparsePrefillBackend
from app.backends.prefill.torch_sparse import TorchSparsePrefillBackend
from app.testing import reference_decode, reference_sparse_attention

H, RANK, ROPE, BS = 2, 64, 32, 4
TOPK, ROWS = 4, 6   # ROWS query rows (decode: 3 requests x query_len 2)
needs_sparse_kernel = pytest.mark.skipif(not CpuSparseDecodeBackend.is_available(),
                                         reason="the native CPU sparse kernel cannot run here")
needs_decode_kernel = pytest.mark.skipif(not CpuMLADecodeBackend.is_available(),
                                         reason="the native CPU decode kernel cannot run here")


class _Hostile:
    """What a hostile hook does before it reads its inputs: clear ``out`` (a kernel that zeroes
    its accumulators in place) and rewrite the tensor in ``victim`` (another thread)."""

    victim: ClassVar[torch.Tensor | None] = None

    @staticmethod
    def strike(out: torch.Tensor) -> None:
        out.zero_()
        if _Hostile.victim is not None:
            _Hostile.victim.fill_(10**6)


class _HostileSparseDecode(TorchSparseDecodeBackend):
    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> None:
        _Hostile.strike(out)
        super()._run_sparse_decode(metadata, q, kv_cache, indices, out, lse, softmax_scale,
                                   k_scale)


class _HostileSparsePrefill(TorchSparsePrefillBackend):
    def _run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                            k_scale: float) -> None:
        _Hostile.strike(out)
        super()._run_sparse_prefill(q, kv, indices, out, lse, softmax_scale, k_scale)


class _HostileDecode(TorchSDPADecodeBackend):
    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        _Hostile.strike(out)
        super()._run_decode(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)


@pytest.fixture(autouse=True)
def _no_victim() -> Any:
    yield
    _Hostile.victim = None


def _sparse_problem(dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[ROWS, H, D]``, a paged cache of 6 blocks, int32 indices ``[ROWS, TOPK]`` into its
    slots (repeats and -1 included) and a shared int32 store they live at the start of."""
    gen = torch.Generator().manual_seed(44)
    q = torch.randn(ROWS, H, RANK + ROPE, generator=gen).to(dtype)
    cache = torch.randn(6, BS, RANK + ROPE, generator=gen).to(dtype)
    store = torch.zeros(ROWS * max(TOPK, H * RANK), dtype=torch.int32)
    idx = store[:ROWS * TOPK].view(ROWS, TOPK)
    idx.copy_(torch.randint(0, 6 * BS, (ROWS, TOPK), generator=gen, dtype=torch.int32))
    idx[1, 1], idx[2, 3], idx[4] = -1, idx[2, 0], -1
    return q, cache, idx, store


def _out_over(store: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """An out= of ``shape`` and ``dtype`` over the first bytes of ``store``."""
    n = 1
    for d in shape:
        n *= d
    return store.view(dtype)[:n].view(shape)


def _sparse_decode(cls: type[MLADecodeBackend], dtype: torch.dtype = torch.float32
                   ) -> MLADecodeBackend:
    be = cls(H, 0.2, RANK, ROPE, dtype)
    be.prepare_metadata(MLADecodeMetadata.build(
        torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
        torch.tensor([8, 6, 7], dtype=torch.int32), 2))
    return be


def _sparse_prefill(cls: type[MLAPrefillBackend]) -> MLAPrefillBackend:
    return cls(num_heads=H, scale=0.2, kv_lora_rank=RANK, qk_nope_head_dim=16,
               qk_rope_head_dim=ROPE, v_head_dim=16)


def _run_sparse(kind: str, be: Any, q: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor,
                out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "decode":
        got, lse = be.run_sparse_decode(q.view(3, 2, H, -1), cache, idx.view(3, 2, TOPK),
                                        out=out, return_softmax_lse=True)
        return got.reshape(ROWS, H, RANK), lse.reshape(H, ROWS).t()
    got, lse = be.run_sparse_prefill(q, cache.view(-1, RANK + ROPE), idx, out=out,
                                     return_softmax_lse=True)
    return got, lse.t()


def _check_sparse(got: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, cache: torch.Tensor,
                  idx: torch.Tensor, tol: float) -> None:
    want_out, want_lse = reference_sparse_attention(q, cache.view(-1, RANK + ROPE), idx, RANK,
                                                    0.2)
    torch.testing.assert_close(got[0].double(), want_out, atol=tol, rtol=0)
    torch.testing.assert_close(got[1].double(), want_lse, atol=tol, rtol=0)


_SPARSE_CASES = [("decode", _HostileSparseDecode), ("prefill", _HostileSparsePrefill)]
_NATIVE_SPARSE = [pytest.param("decode", CpuSparseDecodeBackend, marks=needs_sparse_kernel),
                  pytest.param("prefill", CpuSparsePrefillBackend, marks=needs_sparse_kernel)]


@pytest.mark.parametrize(("kind", "cls"), [*_SPARSE_CASES, ("decode", TorchSparseDecodeBackend),
                                           ("prefill", TorchSparsePrefillBackend),
                                           *_NATIVE_SPARSE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_out_over_the_callers_indices_is_written_after_the_kernel(
        kind: str, cls: type, dtype: torch.dtype) -> None:
    q, cache, idx, store = _sparse_problem(dtype)
    want = idx.clone()
    be = _sparse_decode(cls, dtype) if kind == "decode" else _sparse_prefill(cls)
    out = _out_over(store, dtype, (3, 2, H, RANK) if kind == "decode" else (ROWS, H, RANK))
    got = _run_sparse(kind, be, q, cache, idx, out)
    assert got[0].data_ptr() == out.data_ptr()          # out= is what the verb returned
    _check_sparse(got, q, cache, want, 1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(("kind", "cls"), [*_SPARSE_CASES])
def test_the_kernel_reads_the_checked_copy_of_the_indices_not_the_callers(
        kind: str, cls: type) -> None:
    """The hook rewrites the caller's indices out of range between the check and its read
    (what a second thread may do): it must still read the values that were checked."""
    q, cache, idx, _ = _sparse_problem()
    want = idx.clone()
    _Hostile.victim = idx
    be = _sparse_decode(cls) if kind == "decode" else _sparse_prefill(cls)
    _check_sparse(_run_sparse(kind, be, q, cache, idx, None), q, cache, want, 1e-4)


def _rewriter(idx: torch.Tensor, good: torch.Tensor, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            idx.fill_(10**6)
            idx.copy_(good)
    return threading.Thread(target=run, daemon=True)


@pytest.mark.parametrize(("kind", "cls"), [("decode", TorchSparseDecodeBackend),
                                           ("prefill", TorchSparsePrefillBackend),
                                           *_NATIVE_SPARSE])
@pytest.mark.slow
def test_a_thread_rewriting_the_indices_during_calls(kind: str, cls: type) -> None:
    """Every call either refuses the indices it copied (some were out of range at the copy) or
    attends exactly the good ones; none reads a rewritten value (a native kernel would crash)."""
    q, cache, idx, _ = _sparse_problem()
    good = idx.clone()
    be = _sparse_decode(cls) if kind == "decode" else _sparse_prefill(cls)
    stop = threading.Event()
    thread = _rewriter(idx, good, stop)
    thread.start()
    refused = ran = 0
    try:
        for _ in range(150):
            try:
                got = _run_sparse(kind, be, q, cache, idx, None)
            except ValueError as exc:
                assert "out of range" in str(exc)
                refused += 1
                continue
            _check_sparse(got, q, cache, good, 1e-4)
            ran += 1
    finally:
        stop.set()
        thread.join()
    assert refused + ran == 150


# -- dense decode: the step's block tables and lengths --------------------------------------

def _dense_step(width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 requests (query_len 1) over 9 blocks: block table ``[3, width]`` (unused entries 0),
    seq_lens, q and the cache."""
    gen = torch.Generator().manual_seed(7)
    table = torch.zeros(3, width, dtype=torch.int32)
    table[:, :3] = torch.randperm(9, generator=gen).to(torch.int32).view(3, 3)
    lens = torch.tensor([9, 5, 12], dtype=torch.int32)
    return (table, lens, torch.randn(3, 1, H, RANK + ROPE, generator=gen),
            torch.randn(9, BS, RANK + ROPE, generator=gen))


def _check_dense(got: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor) -> None:
    want, _ = reference_decode(q, cache, table, lens.tolist(), RANK, 0.2, 1.0)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


_DENSE = [_HostileDecode, pytest.param(CpuMLADecodeBackend, marks=needs_decode_kernel)]


@pytest.mark.parametrize("cls", _DENSE)
@pytest.mark.parametrize("which", ["block_table", "seq_lens"])
def test_an_out_over_the_callers_block_table_or_seq_lens(cls: type, which: str) -> None:
    table, lens, q, cache = _dense_step(H * RANK)
    want_table, want_lens = table.clone(), lens.clone()
    if which == "seq_lens":     # seq_lens at the start of one int32 store out= covers
        store = torch.zeros(3 * H * RANK, dtype=torch.int32)
        store[:3] = lens
        lens, target = store[:3], store
    else:
        target = table
    be = cls(H, 0.2, RANK, ROPE, torch.float32)
    be.prepare_metadata(MLADecodeMetadata.build(table, lens, 1))
    out = _out_over(target, torch.float32, (3, 1, H, RANK))
    got = be.run_decode(q, cache, out=out)
    _check_dense(got, q, cache, want_table, want_lens)
    _check_dense(be.run_decode(q, cache), q, cache, want_table, want_lens)   # the next layer


@pytest.mark.parametrize("cls", _DENSE)
def test_an_out_over_the_steps_own_block_table_is_refused(cls: type) -> None:
    """The metadata's snapshot is read by every layer of the step: written into, even after
    the kernel, it would send the next layer's kernel to other blocks."""
    table, lens, q, cache = _dense_step(H * RANK)
    be = cls(H, 0.2, RANK, ROPE, torch.float32)
    meta = MLADecodeMetadata.build(table, lens, 1)
    be.prepare_metadata(meta)
    out = _out_over(meta.block_table_cpu, torch.float32, (3, 1, H, RANK))
    with pytest.raises(ValueError, match="out shares memory with the step's metadata"):
        be.run_decode(q, cache, out=out)
    _check_dense(be.run_decode(q, cache), q, cache, table, lens)


@pytest.mark.parametrize("cls", _DENSE)
def test_metadata_made_field_by_field_is_copied_before_any_kernel_reads_it(cls: type) -> None:
    """A metadata made with the caller's own tensors as its snapshots, which the caller then
    rewrites out of range (as another thread may): the kernel reads the checked copies."""
    table, lens, q, cache = _dense_step(3)
    mine = MLADecodeMetadata(block_table=table, seq_lens=lens, block_table_cpu=table,
                             seq_lens_cpu=lens, query_len=1, seq_lens_list=(9, 5, 12),
                             max_seq_len=12)
    want = table.clone()
    be = cls(H, 0.2, RANK, ROPE, torch.float32)
    be.prepare_metadata(mine)
    table.fill_(10**6)
    _check_dense(be.run_decode(q, cache), q, cache, want, lens)
