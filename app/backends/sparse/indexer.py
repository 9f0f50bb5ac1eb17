"""The lightning indexer of DeepSeek Sparse Attention: scores and top-k over a paged key cache.

Per layer, every token has one indexer key of ``index_head_dim`` values (``k_norm(wk x)``, its
first ``qk_rope_head_dim`` values roped), cached in a paged cache of its own,
``key_cache [num_blocks, block_size, index_head_dim]`` (the model's dtype; contiguous
``index_head_dim`` values per token, in blocks, so a kernel streams them). It shares the latent
cache's block table: block ``b`` of a request holds the same tokens in both. Each query row has
``index_n_heads`` query vectors and weights and scores every key it may see::

    score(t, s) = sum_h weights[t, h] * relu(q[t, h] . key[s])

``weights`` carry the model's scales (``weights_proj(x) * index_n_heads ** -0.5 *
index_head_dim ** -0.5``: relu commutes with a positive scale, so transformers'
``sum_h w_h * H^-0.5 * relu(D^-0.5 * q_h . k)`` is this sum). Row ``t`` sees the keys at
positions ``[0, visible[t])`` of its request (causal: its own token included) and keeps the
``topk`` best: ``[T, width]`` int32 positions, best first, ``-1`` where fewer than ``width`` keys
are visible. ``width`` is ``min(topk, the most keys any row of the step sees)``: no row can
name more, so the columns past it could only hold padding, and a model's ``index_topk`` (up to
int32's range) never sizes a step's tensors (as transformers takes ``min(index_topk, T)``).
Ties at the ``topk``-th score are broken as ``torch.topk`` breaks them (any of the tied keys
is a right answer; the float64 check counts such rows apart).

``SparseIndexer`` is the contract (its ``select`` checks every input, then calls the hook
``_select``); ``TorchSparseIndexer`` runs it in plain torch, in float32, request by request and a
bounded block of rows at a time (never a ``[T, T]`` score matrix). ``SparseIndexerMetadata``
is one step's layout (built once per step, shared by every layer); ``to_slots`` turns the
selected positions into rows of the flat latent cache, what the ``run_sparse_*`` verbs read.
"""

from __future__ import annotations

import itertools
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import attrs
import torch

from app._validation import INT32_MAX, check_dense, check_int_at_least
from app.backends.contract import check_hook_result
from app.backends.declarations import BackendDeclarations

__all__ = ["SCORE_BUDGET", "SparseIndexer", "SparseIndexerMetadata", "TorchSparseIndexer",
           "topk_positions"]

#: Most float32 scores ``TorchSparseIndexer`` holds at once (per-head scores of a block of
#: rows over one request's keys): 64 MiB.
SCORE_BUDGET = 1 << 24


def topk_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best of each row of ``scores [rows, n]`` (``-inf``: not a candidate) as
    ``[rows, topk]`` int32 positions in increasing order, ``-1`` padding at the end; of keys
    tied at the ``topk``-th score, the earliest positions are kept. Only the result is
    ``topk`` wide (an indexer passes the step's ``min(topk, keys)``, see the module)."""
    rows, n = scores.shape
    keep = min(topk, n)
    out = torch.full((rows, topk), -1, dtype=torch.int32, device=scores.device)
    if not keep or not rows:
        return out
    kth = torch.topk(scores, keep, dim=1).values[:, -1:]                    # [rows, 1]
    candidate = torch.isfinite(scores)
    above = (scores > kth) & candidate
    tied = (scores == kth) & candidate
    room = keep - above.sum(dim=1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=1) <= room))
    rank = chosen.cumsum(dim=1) - 1                                          # its slot
    position = torch.arange(n, device=scores.device, dtype=torch.int32).expand(rows, n)
    # Only the first ``keep`` columns can be chosen: the scatter is no wider than the scores.
    wide = torch.full((rows, keep + 1), -1, dtype=torch.int32, device=scores.device)
    wide.scatter_(1, torch.where(chosen, rank, keep), position)
    out[:, :keep] = wide[:, :keep]
    return out


@attrs.define(eq=False)
class SparseIndexerMetadata:
    """One step's layout for the indexer, shared by every layer of the step.

    ``block_table`` int32 ``[B, W]`` (request ``b``'s blocks, as the latent cache's; on the
    cache's device), ``query_start`` the host offsets ``[B + 1]`` of each request's query rows
    (rows are request-major), ``visible`` int64 ``[T]`` on the device and ``visible_list`` on the
    host: row ``t`` sees positions ``[0, visible[t])`` of its request, ``seq_lens`` the most any
    row of each request sees (its keys are read up to there). Make it with :meth:`build`."""

    block_table: torch.Tensor
    query_start: tuple[int, ...]
    visible: torch.Tensor
    seq_lens: tuple[int, ...]
    query_request: torch.Tensor
    _block_table_long: torch.Tensor = attrs.field(init=False, repr=False)
    _checked: set[tuple[int, int]] = attrs.field(init=False, factory=set, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    def __attrs_post_init__(self) -> None:
        self._block_table_long = self.block_table.to(torch.long)

    @property
    def num_rows(self) -> int:
        """Query rows ``T``."""
        return self.query_start[-1]

    @property
    def batch(self) -> int:
        """Requests ``B``."""
        return len(self.query_start) - 1

    @classmethod
    def build(cls, block_table: torch.Tensor, query_lens: Sequence[int],
              visible: Sequence[int], *, device: torch.device | str | None = None,
              what: str = "SparseIndexerMetadata.build") -> SparseIndexerMetadata:
        """Check a step's layout: ``block_table`` int32/int64 ``[B, W]``, ``query_lens`` the
        rows of each request (>= 0), ``visible`` one count per row (request-major, ``1 <=
        visible <= W * block_size`` is checked against the cache in ``select``). ``ValueError``
        / ``TypeError`` naming ``what`` otherwise."""
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"{what}: block_table must be a torch.Tensor, got "
                            f"{type(block_table).__name__}")
        check_dense(f"{what}: block_table", block_table)
        if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: block_table must be a 2-D int32 tensor [B, W], got "
                             f"{block_table.dtype} {list(block_table.shape)}")
        lens = [int(n) for n in query_lens]
        if len(lens) != block_table.shape[0] or any(n < 0 for n in lens):
            raise ValueError(f"{what}: expected {block_table.shape[0]} query lengths >= 0 "
                             f"(one per block-table row), got {lens}")
        seen = [int(v) for v in visible]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        if len(seen) != starts[-1] or any(v < 1 for v in seen):
            raise ValueError(f"{what}: expected {starts[-1]} visible counts >= 1 (one per query "
                             f"row: a row sees its own token), got {len(seen)} "
                             f"(smallest {min(seen, default=None)})")
        dev = torch.device(device) if device is not None else block_table.device
        table = block_table.detach().to("cpu", torch.int64)
        if table.numel() and not -INT32_MAX - 1 <= int(table.min()) <= int(table.max()) \
                <= INT32_MAX:
            raise ValueError(f"{what}: block ids must fit int32 (refused, not narrowed), got "
                             f"[{int(table.min())}, {int(table.max())}]")
        table = table.to(torch.int32)
        seq_lens = tuple(max(seen[a:b], default=0) for a, b in itertools.pairwise(starts))
        request = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens,
                                                                                dtype=torch.long))
        return cls(block_table=table.to(dev), query_start=tuple(starts),
                   visible=torch.tensor(seen, dtype=torch.int64, device=dev),
                   seq_lens=seq_lens, query_request=request.to(dev))

    def check_cache(self, what: str, block_size: int, num_blocks: int) -> None:
        """Every block a row reads is in its table row and in a cache of this geometry
        (checked once per geometry and step)."""
        key = (block_size, num_blocks)
        with self._lock:
            if key in self._checked:
                return
        table = self.block_table.cpu()
        width = int(table.shape[1])
        for b, seq_len in enumerate(self.seq_lens):
            needed = -(-seq_len // block_size)
            if needed > width:
                raise ValueError(f"{what}: request {b} sees {seq_len} tokens, which need "
                                 f"{needed} blocks of {block_size}; its block table has {width}")
            used = table[b, :needed]
            if needed and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
                raise ValueError(f"{what}: request {b}'s block table holds a block outside "
                                 f"[0, {num_blocks}): {used.tolist()}")
        with self._lock:
            self._checked.add(key)

    def to_slots(self, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """Selected ``positions [T, width]`` (int32, ``-1`` padding) as rows of the flat latent
        cache (``block_id * block_size + offset``, int32, ``-1`` kept): what the
        ``run_sparse_*`` verbs read. Positions come from ``select`` (within each row's
        visible tokens, whose blocks ``check_cache`` checked)."""
        pos = positions.to(torch.long)
        valid = pos >= 0
        pos = pos.clamp(min=0)
        blocks = self._block_table_long[self.query_request.unsqueeze(1), pos // block_size]
        slots = blocks * block_size + pos % block_size
        return torch.where(valid, slots, -1).to(torch.int32)


def _selection_width(metadata: SparseIndexerMetadata, topk: int) -> int:
    """The columns a top-``topk`` selection of ``metadata``'s step needs: ``min(topk, the most
    keys any row sees)`` (at least 1: the sparse verbs read ``topk >= 1`` columns)."""
    return max(1, min(topk, max(metadata.seq_lens, default=1)))


class SparseIndexer(BackendDeclarations):
    """The indexer contract (see the module docstring): ``select(q, weights, key_cache,
    metadata, topk)`` checks every input, then the hook ``_select`` writes the top-k.

    Declarations as a backend's (``name``, ``supported_dtypes`` of the key cache, ``probe``,
    ``install_hint``): a native indexer declares where it runs, as a native backend does."""

    name: ClassVar[str | None] = None
    supported_dtypes: ClassVar[Sequence[torch.dtype]] = (
        torch.float16, torch.bfloat16, torch.float32)

    def select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
               metadata: SparseIndexerMetadata, topk: int) -> torch.Tensor:
        """The top-``topk`` visible positions of every query row.

        ``q [T, index_n_heads, index_head_dim]`` (any float dtype, roped), ``weights [T,
        index_n_heads]`` float32 (the scales folded in), ``key_cache [num_blocks, block_size,
        index_head_dim]`` of a ``supported_dtypes`` dtype on q's device. Returns ``[T,
        width]`` int32 positions (increasing, ``-1`` padding at the end; ties to the earliest),
        ``width = min(topk, max(metadata.seq_lens))``: the columns a wider result would add
        could hold only padding (see the module docstring)."""
        what = f"{type(self).__name__}.select"
        check_int_at_least(f"{what}: topk", topk, 1)
        if not isinstance(metadata, SparseIndexerMetadata):
            raise TypeError(f"{what}: metadata must be a SparseIndexerMetadata, got "
                            f"{type(metadata).__name__}")
        _check_inputs(what, q, weights, key_cache, metadata, self.supported_dtypes)
        metadata.check_cache(what, int(key_cache.shape[1]), int(key_cache.shape[0]))
        width = _selection_width(metadata, topk)
        out = torch.full((metadata.num_rows, width), -1, dtype=torch.int32, device=q.device)
        if metadata.num_rows:
            hook: Callable[..., object] = self._select   # None, or a TypeError
            check_hook_result(self, "_select", hook(q, weights, key_cache, metadata, out), out)
        return out

    @abstractmethod
    def _select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                metadata: SparseIndexerMetadata, out: torch.Tensor) -> None:
        """Write each row's best visible positions into ``out [T, width]`` (pre-filled with
        -1; checked inputs, at least one row; ``width = min(topk, max(metadata.seq_lens))``, so
        a row's best ``width`` are its best ``topk``) as ``topk_positions`` orders and ties
        them, and return None (a returned tensor is a ``TypeError``: ``select`` returns
        ``out``)."""


def _check_inputs(what: str, q: object, weights: object, key_cache: object,
                  metadata: SparseIndexerMetadata, dtypes: Sequence[torch.dtype]) -> None:
    for name, t in (("q", q), ("weights", weights), ("key_cache", key_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(f"{what}: {name}", t)
    if not (isinstance(q, torch.Tensor) and isinstance(weights, torch.Tensor)
            and isinstance(key_cache, torch.Tensor)):  # pragma: no cover - checked above
        raise TypeError(what)
    rows = metadata.num_rows
    if q.dim() != 3 or q.shape[0] != rows or not q.dtype.is_floating_point:
        raise ValueError(f"{what}: q must be a float tensor [{rows}, index_n_heads, "
                         f"index_head_dim] (one row per query of the step), got {q.dtype} "
                         f"{list(q.shape)}")
    heads, dim = int(q.shape[1]), int(q.shape[2])
    if list(weights.shape) != [rows, heads] or weights.dtype != torch.float32:
        raise ValueError(f"{what}: weights must be float32 [{rows}, {heads}], got "
                         f"{weights.dtype} {list(weights.shape)}")
    if key_cache.dim() != 3 or key_cache.shape[2] != dim or key_cache.shape[1] < 1:
        raise ValueError(f"{what}: key_cache must be [num_blocks, block_size, {dim}], got "
                         f"{list(key_cache.shape)}")
    if key_cache.dtype not in dtypes:
        raise ValueError(f"{what}: key_cache dtype must be one of {list(dtypes)}, got "
                         f"{key_cache.dtype}")
    for name, t in (("weights", weights), ("key_cache", key_cache),
                    ("metadata.visible", metadata.visible)):
        if t.device != q.device:
            raise ValueError(f"{what}: {name} is on {t.device} but q is on {q.device}")


class TorchSparseIndexer(SparseIndexer):
    """The indexer in plain torch, float32 scores: any device, any key-cache dtype."""

    name: ClassVar[str | None] = "TORCH"

    def _select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                metadata: SparseIndexerMetadata, out: torch.Tensor) -> None:
        block_size, dim = int(key_cache.shape[1]), int(key_cache.shape[2])
        heads, topk = int(q.shape[1]), int(out.shape[1])
        for b, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start[b], metadata.query_start[b + 1]
            if start == end:
                continue
            blocks = metadata.block_table[b, :-(-seq_len // block_size)].to(torch.long)
            keys = key_cache.index_select(0, blocks).reshape(-1, dim)[:seq_len].float()
            rows = max(1, SCORE_BUDGET // (heads * seq_len))
            position = torch.arange(seq_len, device=q.device)
            for r0 in range(start, end, rows):
                r1 = min(r0 + rows, end)
                qr = q[r0:r1].float().reshape(-1, dim)
                scores = torch.matmul(qr, keys.t()).relu_().view(r1 - r0, heads, seq_len)
                total = torch.bmm(weights[r0:r1].unsqueeze(1), scores).squeeze(1)
                hidden = position.unsqueeze(0) >= metadata.visible[r0:r1].unsqueeze(1)
                total.masked_fill_(hidden, float("-inf"))
                out[r0:r1] = topk_positions(total, topk)
