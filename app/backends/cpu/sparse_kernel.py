"""The native CPU kernels of DeepSeek Sparse Attention (``csrc/mla_sparse_cpu.c``: attention;
``csrc/mla_sparse_index_cpu.c``: the indexer and top-k).

Three kernels in one library, built, cached and self-tested by :mod:`app.backends.cpu.loader`
on first use (``APP_CPU_NATIVE_KERNEL=0`` turns it off, as for the other CPU kernels):

- **attention over selected latent rows** (what CPU_MLA_SPARSE's ``run_sparse_decode`` and
  ``run_sparse_prefill`` run): each query row attends to the rows its int32 indices name, as
  :func:`app.backends.sparse.sparse_attention_rows` defines it (``-1`` padding skipped, a
  repeat one term per entry, a row naming nothing out 0 and LSE ``-inf``). The rows are read
  in place (a paged cache's flat slots, or rows of a tensor), each loaded once for all heads;
  q.k and p.v run on AVX512-BF16 dot products for a bf16 cache and q on a CPU that has them
  (p rounded to bf16 for p.v, as CPU_MLA does, the LSE from the unrounded float32 sum;
  ``APP_CPU_DECODE_BF16_DOT=0`` keeps float32),
  with float32 sums. Work is
  dealt as (row, range of its entries): a step with fewer rows than threads splits each row's
  entries into parts merged by LSE, so a decode step of a few requests uses every core.
- **the lightning indexer's scores** ``sum_h w[t, h] * relu(q[t, h] . key[s])`` over a
  request's paged key cache, read in place through its block table (each row's q packed once
  with the heads along the vector lanes, each key's values broadcast against them; items of up
  to 8 rows of a request and a range of its keys), float32 sums (bf16 products on the dot
  path);
- **top-k** of those scores exactly as :func:`app.backends.sparse.indexer.topk_positions`
  orders and ties them (a radix select of the k-th score, then one pass in position order). A
  row holding a non-finite score is handed back and ordered by ``topk_positions`` itself.

Threads: the items of a call are dealt onto ``torch.get_num_threads()`` shares run by
:func:`app.backends.cpu.pool.run_shares` (one C call each; ctypes releases the GIL). Memory per
call: one scratch buffer per share (:mod:`app.backends.cpu.scratch`), the partial outputs of
split rows, and the indexer's scores for a bounded block of rows (``SCORE_BUDGET`` floats).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
from collections.abc import Callable, Sequence

import torch

from app.backends.cpu.decode_kernel import BF16_DOT_ENV, has_bf16_dot
from app.backends.cpu.loader import (
    NativeLibrary,
    NativeLibrarySpec,
    NativeLibraryStatus,
    load_native_library,
)
from app.backends.cpu.pool import run_shares
from app.backends.cpu.prefill_kernel import SWITCH_ENV, _requirements
from app.backends.cpu.scratch import thread_scratch
from app.backends.sparse.indexer import SCORE_BUDGET, topk_positions

__all__ = ["SPEC", "NativeSparseKernel", "SparseAttnArgs", "SparseIndexArgs",
           "load_sparse_kernel", "sparse_kernel_status", "sparse_kernel_unavailable_reason"]

#: ``MLA_SPARSE_CPU_ABI`` in ``csrc/mla_sparse_cpu.h``.
ABI_VERSION = 3
#: Most parts one row's entries are split into (the C merge's limit).
MAX_PARTS = 64
#: A row is split only into parts of at least this many entries.
MIN_ENTRIES_PER_PART = 256
#: Most query rows of one indexer item (``IR`` in the C source).
INDEX_ROWS = 8
#: Indexer key ranges are cut at multiples of this many keys (whole register tiles).
INDEX_TILE = 32
#: Largest per-thread scratch buffer kept between calls.
SCRATCH_KEEP_BYTES = 64 << 20
_LOG2E = 1.0 / math.log(2.0)
_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float


class SparseAttnArgs(ctypes.Structure):
    """``mla_sparse_attn_args`` of ``csrc/mla_sparse_cpu.h`` (layout checked at load)."""

    _fields_ = [
        ("kv", _ptr), ("q", _ptr), ("indices", _ptr), ("out", _ptr), ("lse", _ptr),
        ("items", _ptr), ("merge", _ptr), ("part_out", _ptr), ("part_lse", _ptr),
        ("scratch", _ptr), ("rows", _i64), ("heads", _i64), ("rank", _i64), ("rope", _i64),
        ("topk", _i64), ("block_size", _i64), ("block_stride", _i64), ("row_stride", _i64),
        ("q_st", _i64), ("q_sh", _i64), ("n_items", _i64), ("n_merge", _i64),
        ("kv_rows", _i64), ("kv_dt", _i32), ("q_dt", _i32), ("out_dt", _i32), ("bf16_dot", _i32),
        ("q_mult", _f32), ("v_mult", _f32)]


class SparseIndexArgs(ctypes.Structure):
    """``mla_sparse_index_args`` of ``csrc/mla_sparse_cpu.h`` (layout checked at load)."""

    _fields_ = [
        ("q", _ptr), ("weights", _ptr), ("key_cache", _ptr), ("block_table", _ptr),
        ("visible", _ptr), ("scores", _ptr), ("items", _ptr), ("scratch", _ptr),
        ("heads", _i64), ("dim", _i64), ("block_size", _i64), ("block_stride", _i64),
        ("row_stride", _i64), ("q_st", _i64), ("q_sh", _i64), ("bt_stride", _i64),
        ("score_stride", _i64), ("score_row0", _i64), ("n_items", _i64),
        ("key_dt", _i32), ("q_dt", _i32), ("bf16_dot", _i32), ("pad0", _i32)]


def _workers() -> int:
    return max(1, torch.get_num_threads())


def _deal(items: list[tuple[int, ...]], costs: Sequence[int], workers: int
          ) -> list[torch.Tensor]:
    """``items`` dealt onto at most ``workers`` shares (costliest first, each to the least
    loaded), each an int64 tensor of its items' rows."""
    loads = [0] * max(1, min(workers, len(items)))
    dealt: list[list[tuple[int, ...]]] = [[] for _ in loads]
    for i in sorted(range(len(items)), key=lambda i: costs[i], reverse=True):
        w = loads.index(min(loads))
        dealt[w].append(items[i])
        loads[w] += costs[i] + 16
    return [torch.tensor(d, dtype=torch.int64) for d in dealt if d]


def _run_dealt(shares: Sequence[torch.Tensor], call: Callable[[torch.Tensor], int],
               what: str) -> None:
    """``call(items)`` for every share on the pool; ``ValueError`` if the C side refused one."""
    failures: list[int] = []

    def share_of(items: torch.Tensor) -> Callable[[], None]:
        def work() -> None:
            if call(items):
                failures.append(1)
        return work

    run_shares([share_of(items) for items in shares])
    if failures:
        raise ValueError(f"native CPU sparse kernel refused the {what} call")


class NativeSparseKernel:
    """The loaded library: :meth:`attend` (sparse attention), :meth:`scores` and
    :meth:`topk` (the indexer), on checked CPU tensors."""

    def __init__(self, library: NativeLibrary) -> None:
        self.library = library
        self._attn = library.function("mla_sparse_attn_run", _i32, ctypes.POINTER(SparseAttnArgs))
        self._merge = library.function("mla_sparse_attn_merge", _i32,
                                       ctypes.POINTER(SparseAttnArgs))
        self._attn_floats = library.function("mla_sparse_attn_scratch_floats", _i64, _i64, _i64,
                                             _i64)
        self._index = library.function("mla_sparse_index_run", _i32,
                                       ctypes.POINTER(SparseIndexArgs))
        self._index_floats = library.function("mla_sparse_index_scratch_floats", _i64, _i64,
                                              _i64)
        self._topk = library.function("mla_sparse_topk", _i32, _ptr, _i64, _ptr, _i64, _i64,
                                      _i64, _ptr, _i64, _ptr, _ptr)

    # -- attention -----------------------------------------------------------------------

    def attend(self, q: torch.Tensor, kv: torch.Tensor, block_size: int,
               indices: torch.Tensor, kv_lora_rank: int, out: torch.Tensor,
               lse: torch.Tensor | None, softmax_scale: float, k_scale: float,
               bf16_dot: bool | None = None) -> None:
        """Attention of ``q [T, H, D]`` (unit last stride) over the rows of ``kv`` that
        ``indices [T, topk]`` names: ``kv`` a paged cache ``[num_blocks, block_size, D]``
        (slot ``i`` = block ``i // block_size``, offset ``i % block_size``) or rows ``[N, D]``
        (``block_size`` 1), unit last stride, q's dtype. Writes ``out [T, H, kv_lora_rank]``
        (contiguous, any of fp32/bf16/fp16) and ``lse [T, H]`` (float32 contiguous, natural
        log) when given.

        ``indices`` is int32 contiguous and already checked to be in range: a private copy no
        other thread writes, as the backends' bases hand it, with no ``out`` over it. The C
        side checks each share's entries again and refuses one holding an index outside
        ``[-1, rows of kv)`` with ``ValueError``; other shares' rows of ``out`` may be written
        by then."""
        rows, heads, dim = (int(x) for x in q.shape)
        if rows == 0:
            return
        topk = int(indices.shape[1])
        if kv.dim() == 2:
            block_stride, row_stride = int(kv.stride(0)), 0
            kv_rows = int(kv.shape[0])
        else:
            block_stride, row_stride = int(kv.stride(0)), int(kv.stride(1))
            kv_rows = int(kv.shape[0]) * int(kv.shape[1])
        if bf16_dot is None:
            bf16_dot = q.dtype == kv.dtype == torch.bfloat16 and has_bf16_dot()
        codes = self.library.dtype_code
        workers = _workers()
        split = 1 if rows >= 2 * workers else max(
            1, min(MAX_PARTS, topk // MIN_ENTRIES_PER_PART, -(-2 * workers // rows)))
        items: list[tuple[int, ...]] = []
        merge: list[tuple[int, int, int]] = []
        parts = 0
        for t in range(rows):
            if split == 1:
                items.append((t, 0, topk, -1))
                continue
            merge.append((t, parts, split))
            items.extend((t, topk * p // split, topk * (p + 1) // split, parts + p)
                         for p in range(split))
            parts += split
        part_out = torch.empty(parts, heads, kv_lora_rank) if parts else None
        part_lse = torch.empty(parts, heads) if parts else None
        merge_t = torch.tensor(merge, dtype=torch.int64).reshape(-1, 3)
        base = SparseAttnArgs(
            kv=kv.data_ptr(), q=q.data_ptr(), indices=indices.data_ptr(), out=out.data_ptr(),
            lse=None if lse is None else lse.data_ptr(), merge=merge_t.data_ptr(),
            part_out=None if part_out is None else part_out.data_ptr(),
            part_lse=None if part_lse is None else part_lse.data_ptr(),
            rows=rows, heads=heads, rank=kv_lora_rank, rope=dim - kv_lora_rank, topk=topk,
            block_size=block_size, block_stride=block_stride, row_stride=row_stride,
            q_st=q.stride(0), q_sh=q.stride(1), n_merge=len(merge), kv_rows=kv_rows,
            kv_dt=codes(kv.dtype),
            q_dt=codes(q.dtype), out_dt=codes(out.dtype), bf16_dot=int(bool(bf16_dot)),
            q_mult=softmax_scale * k_scale * _LOG2E, v_mult=k_scale)
        floats = int(self._attn_floats(heads, kv_lora_rank, dim - kv_lora_rank))

        def call(share: torch.Tensor) -> int:
            scratch = thread_scratch(floats, SCRATCH_KEEP_BYTES)  # held until C returns
            args = SparseAttnArgs.from_buffer_copy(base)
            args.items, args.n_items = share.data_ptr(), share.shape[0]
            args.scratch = scratch.data_ptr()
            return int(self._attn(ctypes.byref(args)))

        shares = _deal(items, [it[2] - it[1] for it in items], workers)
        _run_dealt(shares, call, f"attention (dtypes {q.dtype}/{kv.dtype}/{out.dtype}, "
                                 f"kv_lora_rank {kv_lora_rank}, head dim {dim})")
        if merge and self._merge(ctypes.byref(base)):
            raise ValueError("native CPU sparse kernel refused the merge")

    # -- the indexer -----------------------------------------------------------------------

    def scores(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
               block_table: torch.Tensor, visible: torch.Tensor,
               rows: Sequence[tuple[int, int, int]], scores: torch.Tensor, row0: int,
               bf16_dot: bool | None = None) -> None:
        """The indexer's scores of query rows into ``scores [R, S]`` (float32 contiguous;
        row ``t`` at ``scores[t - row0]``): ``rows`` lists (request, first row, end row) of
        checked inputs (``q [T, heads, dim]`` unit last stride, ``weights [T, heads]``
        float32 contiguous, ``key_cache [num_blocks, block_size, dim]`` unit last stride,
        ``block_table`` int32 ``[B, W]`` unit last stride, ``visible`` int64 ``[T]``
        contiguous). Row ``t``'s positions ``[0, visible[t])`` are scored; later positions up
        to the farthest any row of its block of 8 sees get ``-inf``; the rest are not written."""
        heads, dim = int(q.shape[1]), int(q.shape[2])
        if bf16_dot is None:
            bf16_dot = (q.dtype == key_cache.dtype == torch.bfloat16 and dim % 2 == 0
                        and has_bf16_dot())
        workers = _workers()
        seen = visible.tolist()
        blocks = [(b, r0, min(r0 + INDEX_ROWS, end), max(seen[r0:min(r0 + INDEX_ROWS, end)]))
                  for b, start, end in rows for r0 in range(start, end, INDEX_ROWS)]
        # Each block's keys cut into ranges of at least 1024, enough to feed every worker twice.
        pieces = max(1, -(-2 * workers // max(1, len(blocks))))
        items: list[tuple[int, ...]] = []
        for b, r0, r1, n in blocks:
            span = -(-max(1024, -(-n // pieces)) // INDEX_TILE) * INDEX_TILE
            items.extend((b, r0, r1, k0, min(k0 + span, n)) for k0 in range(0, n, span))
        codes = self.library.dtype_code
        base = SparseIndexArgs(
            q=q.data_ptr(), weights=weights.data_ptr(), key_cache=key_cache.data_ptr(),
            block_table=block_table.data_ptr(), visible=visible.data_ptr(),
            scores=scores.data_ptr(), heads=heads, dim=dim, block_size=key_cache.shape[1],
            block_stride=key_cache.stride(0), row_stride=key_cache.stride(1),
            q_st=q.stride(0), q_sh=q.stride(1), bt_stride=block_table.stride(0),
            score_stride=scores.stride(0), score_row0=row0, key_dt=codes(key_cache.dtype),
            q_dt=codes(q.dtype), bf16_dot=int(bool(bf16_dot)))
        floats = int(self._index_floats(heads, dim))

        def call(share: torch.Tensor) -> int:
            scratch = thread_scratch(floats, SCRATCH_KEEP_BYTES)
            args = SparseIndexArgs.from_buffer_copy(base)
            args.items, args.n_items = share.data_ptr(), share.shape[0]
            args.scratch = scratch.data_ptr()
            return int(self._index(ctypes.byref(args)))

        shares = _deal(items, [(it[2] - it[1]) * (it[4] - it[3]) for it in items], workers)
        _run_dealt(shares, call, f"indexer (dtypes {q.dtype}/{key_cache.dtype}, {heads} "
                                 f"heads of {dim})")

    def topk(self, scores: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
        """Each row's best ``out.shape[1]`` positions among its first ``counts[r]`` scores
        (``scores [R, S]`` float32 contiguous, ``counts`` int64 ``[R]``, ``out [R, topk]``
        int32 contiguous pre-filled with -1), ordered and tied as ``topk_positions`` does."""
        rows, topk = int(out.shape[0]), int(out.shape[1])
        if rows == 0:
            return
        flags = torch.zeros(rows, dtype=torch.int32)
        width = max(1, int(counts.max()))
        workers = _workers()
        bounds = [rows * w // workers for w in range(workers + 1)]
        spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        failures: list[int] = []

        def share_of(a: int, b: int) -> Callable[[], None]:
            def work() -> None:
                scratch = torch.empty(width, dtype=torch.int32)
                if self._topk(scores.data_ptr(), scores.stride(0), counts.data_ptr(), a, b,
                              topk, out.data_ptr(), out.stride(0), flags.data_ptr(),
                              scratch.data_ptr()):
                    failures.append(1)
            return work

        run_shares([share_of(a, b) for a, b in spans])
        if failures:
            raise ValueError("native CPU sparse kernel refused the top-k call")
        for r in flags.nonzero().flatten().tolist():  # a non-finite score: torch orders it
            n = int(counts[r])
            out[r] = topk_positions(scores[r:r + 1, :n], topk)[0]

    def select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
               block_table: torch.Tensor, query_start: Sequence[int],
               seq_lens: Sequence[int], visible: torch.Tensor, out: torch.Tensor,
               bf16_dot: bool | None = None) -> None:
        """The whole indexer on checked CPU inputs: scores and top-k of every row into
        ``out [T, topk]`` (pre-filled with -1), a block of rows at a time whose scores stay
        under ``SCORE_BUDGET`` floats."""
        spans = [(b, query_start[b], query_start[b + 1]) for b in range(len(seq_lens))
                 if query_start[b + 1] > query_start[b]]
        width = max((seq_lens[b] for b, _, _ in spans), default=0)
        if not spans or width == 0:
            return
        budget = max(INDEX_ROWS, SCORE_BUDGET // width)
        chunk: list[tuple[int, int, int]] = []
        held = 0
        for b, start, end in spans:
            for r0 in range(start, end, budget):
                r1 = min(end, r0 + budget)
                if held + (r1 - r0) > budget and chunk:
                    self._select_chunk(q, weights, key_cache, block_table, visible, chunk,
                                       width, out, bf16_dot)
                    chunk, held = [], 0
                chunk.append((b, r0, r1))
                held += r1 - r0
        self._select_chunk(q, weights, key_cache, block_table, visible, chunk, width, out,
                           bf16_dot)

    def _select_chunk(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                      block_table: torch.Tensor, visible: torch.Tensor,
                      chunk: list[tuple[int, int, int]], width: int, out: torch.Tensor,
                      bf16_dot: bool | None) -> None:
        """Rows of ``chunk`` (consecutive, request-major) scored into one buffer, then
        ordered."""
        row0, row1 = chunk[0][1], chunk[-1][2]
        scores = torch.empty(row1 - row0, width, dtype=torch.float32)
        self.scores(q, weights, key_cache, block_table, visible, chunk, scores, row0,
                    bf16_dot)
        self.topk(scores, visible[row0:row1], out[row0:row1])


def _self_test(library: NativeLibrary) -> str | None:
    """Attention (paged and flat rows, whole and split rows, padding, repeats, a row naming
    nothing; fp32, bf16 and the bf16 dot path) and the indexer (scores against float64, top-k
    equal to ``topk_positions`` on the kernel's own scores) on small problems."""
    kernel = NativeSparseKernel(library)
    gen = torch.Generator().manual_seed(0)
    paths = [(torch.float32, 1e-4, False), (torch.bfloat16, 3e-2, False)]
    if has_bf16_dot():
        paths.append((torch.bfloat16, 3e-2, True))
    for dtype, tol, dot in paths:
        problem = _attention_self_test(kernel, gen, dtype, tol, dot) or _indexer_self_test(
            kernel, gen, dtype, dot)
        if problem:
            return f"self-test ({dtype}{', bf16 dot' if dot else ''}): {problem}"
    return None


def _attention_self_test(kernel: NativeSparseKernel, gen: torch.Generator, dtype: torch.dtype,
                         tol: float, dot: bool) -> str | None:
    """Three rows (one naming nothing, one with repeats and padding) over a paged cache of 4
    blocks of 5 and, split into parts, over the same rows flat; against float64."""
    rank, rope, heads, topk = 64, 32, 5, 600
    cache = torch.randn(40, 5, rank + rope, generator=gen).to(dtype)
    q = torch.randn(3, heads, rank + rope, generator=gen).to(dtype)
    idx = torch.randint(0, 200, (3, topk), generator=gen, dtype=torch.int32)
    idx[0] = -1
    idx[1, ::7] = -1
    idx[1, 1::9] = 3
    flat = cache.reshape(-1, rank + rope)
    keep = idx.clamp(min=0).long()
    scores = torch.einsum("thd,tkd->thk", q.double(), flat.double()[keep]) * 0.1
    scores = scores.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)))
    ref = torch.einsum("thk,tkr->thr", probs, flat.double()[keep][..., :rank])
    for kv, bs in ((cache, 5), (flat, 1)):
        for threads in (1, 4):
            out, got = torch.empty(3, heads, rank, dtype=dtype), torch.empty(3, heads)
            old = torch.get_num_threads()
            torch.set_num_threads(threads)  # 4 threads over 3 rows: rows split into parts
            try:
                kernel.attend(q, kv, bs, idx, rank, out, got, 0.1, 1.0, bf16_dot=dot)
            finally:
                torch.set_num_threads(old)
            err = max((out.double() - ref).abs().max().item(),
                      (got[1:].double() - lse[1:]).abs().max().item())
            if not (err < tol and bool(torch.isneginf(got[0]).all())):
                return (f"attention against float64: max error {err:.3g} (block size {bs}, "
                        f"{threads} threads), or a row naming nothing has a finite LSE")
    return None


def _indexer_self_test(kernel: NativeSparseKernel, gen: torch.Generator, dtype: torch.dtype,
                       dot: bool) -> str | None:
    """Two requests (3 and 11 rows; 70 and 300 keys in shuffled blocks of 7) with 6 heads of
    64: scores against float64, top-16 equal to ``topk_positions`` on the kernel's scores."""
    heads, dim, bs, topk = 6, 64, 7, 16
    cache = torch.randn(60, bs, dim, generator=gen).to(dtype)
    perm = torch.randperm(60, generator=gen).to(torch.int32)
    table = torch.zeros(2, 43, dtype=torch.int32)  # 70 and 300 keys: 10 and 43 blocks
    table[0, :10], table[1] = perm[:10], perm[10:53]
    seq_lens = [70, 300]
    visible = torch.tensor([68, 69, 70, *range(290, 301)], dtype=torch.int64)
    q = torch.randn(14, heads, dim, generator=gen).to(dtype)
    w = torch.rand(14, heads, generator=gen) - 0.2
    scores = torch.empty(14, 300)
    kernel.scores(q, w, cache, table, visible, [(0, 0, 3), (1, 3, 14)], scores, 0, dot)
    for b, (r0, r1) in enumerate(((0, 3), (3, 14))):
        pos = torch.arange(seq_lens[b])
        keys = cache[table[b].long()[pos // bs], pos % bs].double()
        ref = (torch.einsum("thd,sd->ths", q[r0:r1].double(), keys).relu()
               * w[r0:r1].double().unsqueeze(-1)).sum(1)
        for r in range(r0, r1):
            n = int(visible[r])
            err = (scores[r, :n].double() - ref[r - r0, :n]).abs().max().item()
            if not err < 1e-3 * max(1.0, ref[r - r0, :n].abs().max().item()):
                return f"indexer scores against float64: max error {err:.3g} (row {r})"
    out = torch.full((14, topk), -1, dtype=torch.int32)
    kernel.topk(scores, visible, out)
    hidden = torch.arange(300).unsqueeze(0) >= visible.unsqueeze(1)
    want = topk_positions(scores.masked_fill(hidden, float("-inf")), topk)
    if not torch.equal(out, want):
        return "indexer top-k differs from topk_positions on the same scores"
    return None


#: The sparse kernels' library, for :func:`app.backends.cpu.loader.load_native_library`.
SPEC = NativeLibrarySpec(
    name="mla_sparse_cpu", sources=("mla_sparse_cpu.c", "mla_sparse_index_cpu.c"),
    abi_version=ABI_VERSION,
    flags=("-O3", "-mavx512f", "-mfma", "-mf16c"),
    structs=(("mla_sparse_attn_args", SparseAttnArgs),
             ("mla_sparse_index_args", SparseIndexArgs)),
    self_test=_self_test, requirements=_requirements, switches=(SWITCH_ENV, BF16_DOT_ENV))

_kernel_lock = threading.Lock()
_kernel: list[tuple[NativeLibrary, NativeSparseKernel]] = []


def sparse_kernel_status() -> NativeLibraryStatus:
    """Whether the sparse kernels' library builds, loads and passes its self-test here (built
    on first use); ``reasons`` say why not."""
    return load_native_library(SPEC)


def sparse_kernel_unavailable_reason() -> str:
    """Why the native sparse kernels are unusable here (what their backends and indexer say)."""
    return "native CPU sparse kernel unavailable: " + "; ".join(sparse_kernel_status().reasons)


def load_sparse_kernel() -> NativeSparseKernel | None:
    """The sparse kernels, built and loaded on first use; None where they cannot be (see
    :func:`sparse_kernel_status`)."""
    library = sparse_kernel_status().library
    if library is None:
        return None
    with _kernel_lock:
        if not _kernel or _kernel[0][0] is not library:
            _kernel[:] = [(library, NativeSparseKernel(library))]
        return _kernel[0][1]
