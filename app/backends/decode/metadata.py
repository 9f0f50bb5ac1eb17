"""The decode step's layout: ``MLADecodeMetadata``, what a caller gives ``prepare_metadata``
once per step and every layer of the step reads.

A decode kernel reads the paged cache through the block table, so a block table too narrow for
``seq_lens``, a block id out of range or a query whose batch does not match the table would be
an out-of-bounds read. ``MLADecodeMetadata.build`` checks the step's layout once and keeps its
own int32 host snapshots: never the caller's tensors, so a caller that reuses (rewrites) its
buffers between two layers of a step cannot change what was checked; int64 values that do not
fit int32 are refused, never narrowed (``2**32 + 3`` would otherwise read block 3). Every
failure is a ``ValueError`` (``TypeError`` for a non-tensor) naming the expected and actual
value.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import torch

from app._cpu import copy_to_device
from app._validation import INT32_MAX, check_dense, is_int

__all__ = [
    "MAX_QUERY_LEN",
    "DecodeMetadata",
    "MLADecodeMetadata",
    "check_query_len",
    "host_int32_snapshot",
]

#: The largest uniform query length the contract allows (multi-token prediction).
MAX_QUERY_LEN = 16

_INT_DTYPES = (torch.int32, torch.int64)


def check_query_len(what: str, query_len: object, batch: int, max_query_len: int) -> int:
    """The step's uniform query length (1..``max_query_len``).

    ``query_len`` is an int, or one length per request (a sequence or a 1-D int tensor) that
    must all be equal: decode kernels index the query as ``[B, query_len, ...]``, so a
    non-uniform batch is refused rather than reshaped (reshaping it would no longer match the
    block table row by row)."""
    if isinstance(query_len, torch.Tensor):
        check_dense(f"{what}: query_len", query_len)
        if query_len.dim() != 1 or query_len.dtype not in _INT_DTYPES:
            raise ValueError(f"{what}: query_len as a tensor must be 1-D int32/int64, got shape "
                             f"{list(query_len.shape)} dtype {query_len.dtype}")
        query_len = [int(x) for x in query_len.cpu().tolist()]
    if isinstance(query_len, Sequence) and not isinstance(query_len, (str, bytes)):
        lens = list(query_len)
        if len(lens) != batch:
            raise ValueError(f"{what}: expected {batch} query lengths (one per request), "
                             f"got {len(lens)}")
        if not all(is_int(n) for n in lens):
            raise ValueError(f"{what}: query lengths must be ints, got {lens!r}")
        if len(set(lens)) > 1:
            raise ValueError(f"{what}: decode needs a uniform query_len across the batch, "
                             f"got {sorted(set(lens))} (split the batch by query length)")
        if not lens:
            raise ValueError(f"{what}: an empty batch needs query_len as an int")
        query_len = lens[0]
    if not is_int(query_len) or not 1 <= query_len <= max_query_len:
        raise ValueError(f"{what}: query_len must be an int in [1, {max_query_len}], "
                         f"got {query_len!r}")
    return query_len


def _check_int_tensor(what: str, t: object, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim or t.dtype not in _INT_DTYPES:
        raise ValueError(f"{what}: expected a {dim}-D int32 tensor, got shape {list(t.shape)} "
                         f"dtype {t.dtype}")
    check_dense(what, t)
    return t


def host_int32_snapshot(what: str, t: torch.Tensor) -> torch.Tensor:
    """A contiguous int32 host copy of the int32/int64 tensor ``t`` that is never ``t``'s
    storage (the caller may rewrite its tensor afterwards). An int64 value outside int32 is a
    ``ValueError`` naming its index and value: it is never narrowed."""
    host = t.detach().to("cpu")
    if host.dtype == torch.int64 and host.numel():
        low, high = (int(x) for x in torch.aminmax(host))
        if low < -INT32_MAX - 1 or high > INT32_MAX:
            bad = ((host < -INT32_MAX - 1) | (host > INT32_MAX)).nonzero()[0].tolist()
            index = ", ".join(str(i) for i in bad)
            raise ValueError(f"{what}[{index}] = {int(host[tuple(bad)])} does not fit int32 "
                             f"(block ids and lengths are int32: at most {INT32_MAX}); it is "
                             f"refused, not narrowed")
    snapshot = torch.empty(tuple(host.shape), dtype=torch.int32)
    snapshot.copy_(host)
    return snapshot


@attrs.define(eq=False)
class MLADecodeMetadata:
    """One decode step's layout, shared by every layer of the step: what
    ``MLADecodeBackend.prepare_metadata`` takes (make it with :meth:`build`).

    ``block_table`` int32 ``[B, max_blocks]`` and ``seq_lens`` int32 ``[B]`` as given (any
    device; read for their device only) with int32 contiguous host snapshots (``*_cpu``,
    copies taken and checked at ``build``: what every kernel reads); ``query_len`` the uniform
    number of new tokens per request. ``seq_lens`` counts those new tokens (already in the
    cache). Token ``t`` of request ``b`` is row ``t % block_size`` of block
    ``block_table[b, t // block_size]``.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    block_table_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    query_len: int
    seq_lens_list: tuple[int, ...]
    max_seq_len: int
    # Per-step caches, not part of the layout: never constructor arguments.
    _device_copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = attrs.field(
        init=False, factory=dict, repr=False)
    _checked_caches: set[tuple[int, int]] = attrs.field(init=False, factory=set, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    # Whether the host snapshots are this object's own (made by build): one made field by
    # field holds the caller's tensors, which check_step copies before checking them.
    _own_snapshots: bool = attrs.field(init=False, default=False, repr=False)

    @property
    def batch(self) -> int:
        """The number of requests B."""
        return len(self.seq_lens_list)

    @classmethod
    def build(cls, block_table: object, seq_lens: object, query_len: object = 1, *,
              max_query_len: int = MAX_QUERY_LEN, what: str = "MLADecodeMetadata.build",
              device: torch.device | str | None = None) -> MLADecodeMetadata:
        """Check the step's layout and keep host copies of it.

        ``block_table`` int32 (or int64 within int32) ``[B, max_blocks]``, ``seq_lens`` ``[B]``
        (each ``>= query_len``: they count the step's new tokens), ``query_len`` an int in
        1..``max_query_len`` or one equal length per request (a sequence or a 1-D int tensor).
        ``ValueError`` / ``TypeError`` naming ``what`` and the bad value otherwise.

        ``device``: where the kernels run, for a caller that has the layout on the host (an
        engine's planner): ``block_table`` / ``seq_lens`` on the CPU are checked there and
        copied to ``device`` once, asynchronously (``app._cpu.copy_to_device``), never read
        back; those copies are ``block_table`` / ``seq_lens`` and ``on_device(device)``.
        Without it, the tensors given are kept as they are (host snapshots are read from
        them: a readback when they live on a GPU)."""
        bt = _check_int_tensor(f"{what}: block_table", block_table, 2)
        sl = _check_int_tensor(f"{what}: seq_lens", seq_lens, 1)
        if bt.shape[0] != sl.shape[0]:
            raise ValueError(f"{what}: block_table has {bt.shape[0]} rows but seq_lens has "
                             f"{sl.shape[0]} entries (one row per request)")
        qlen = check_query_len(what, query_len, int(sl.shape[0]), max_query_len)
        # Snapshots, never the caller's tensors: checked here once, read by every layer.
        sl_cpu = host_int32_snapshot(f"{what}: seq_lens", sl)
        lens = tuple(int(x) for x in sl_cpu.tolist())
        for b, n in enumerate(lens):
            if n < qlen:
                raise ValueError(f"{what}: seq_lens[{b}] = {n} is less than query_len {qlen} "
                                 f"(seq_lens count this step's new tokens)")
        table_cpu = host_int32_snapshot(f"{what}: block_table", bt)
        target = None if device is None else torch.device(device)
        copied = False
        if target is not None and target.type != "cpu" \
                and bt.device.type == sl.device.type == "cpu":
            # our own copies of the snapshots: safe to hand every layer
            bt, sl = copy_to_device(table_cpu, target), copy_to_device(sl_cpu, target)
            copied = True
        step = cls(block_table=bt, seq_lens=sl, block_table_cpu=table_cpu, seq_lens_cpu=sl_cpu,
                   query_len=qlen, seq_lens_list=lens, max_seq_len=max(lens, default=0))
        if copied:
            step._device_copies[bt.device] = (bt, sl)
        step._own_snapshots = True
        return step

    def check_step(self, what: str, max_query_len: int) -> MLADecodeMetadata:
        """``self`` if its ``query_len`` is in 1..``max_query_len`` (a backend's own limit) and
        its host snapshots are what :meth:`build` makes; ``ValueError`` otherwise (one made
        field by field may not be trusted: the kernels read those snapshots unchecked). One
        made field by field holds the caller's tensors as its snapshots: a copy of it with
        snapshots of its own is checked and returned instead (a tensor the caller rewrites
        later, or another thread during a call, is never what a kernel reads; O(B * W))."""
        if not is_int(self.query_len) or not 1 <= self.query_len <= max_query_len:
            raise ValueError(f"{what}: query_len must be an int in [1, {max_query_len}], "
                             f"got {self.query_len!r}")
        if not self._own_snapshots:
            table, lens = self.block_table_cpu, self.seq_lens_cpu
            if not (isinstance(table, torch.Tensor) and isinstance(lens, torch.Tensor)
                    and table.dtype == lens.dtype == torch.int32):
                raise ValueError(f"{what}: this MLADecodeMetadata's host snapshots must be "
                                 f"int32 tensors; make it with MLADecodeMetadata.build()")
            own = attrs.evolve(self, block_table_cpu=host_int32_snapshot(what, table),
                               seq_lens_cpu=host_int32_snapshot(what, lens))
            own._own_snapshots = True
            return own.check_step(what, max_query_len)
        table, lens = self.block_table_cpu, self.seq_lens_cpu
        consistent = (
            isinstance(table, torch.Tensor) and isinstance(lens, torch.Tensor)
            and table.dtype == lens.dtype == torch.int32 and table.dim() == 2
            and lens.dim() == 1 and table.device.type == lens.device.type == "cpu"
            and table.is_contiguous() and lens.is_contiguous()
            and table.shape[0] == lens.shape[0] == len(self.seq_lens_list)
            and tuple(lens.tolist()) == self.seq_lens_list
            and all(n >= self.query_len for n in self.seq_lens_list)
            and self.max_seq_len == max(self.seq_lens_list, default=0))
        if not consistent:
            raise ValueError(f"{what}: this MLADecodeMetadata's host snapshots do not match its "
                             f"seq_lens_list / query_len; make it with MLADecodeMetadata.build()")
        return self

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table, seq_lens)`` int32 contiguous on ``device`` (copied once per step)."""
        with self._lock:
            pair = self._device_copies.get(device)
            if pair is None:
                if device.type == "cpu":
                    pair = (self.block_table_cpu, self.seq_lens_cpu)
                else:
                    pair = (self.block_table_cpu.to(device), self.seq_lens_cpu.to(device))
                self._device_copies[device] = pair
            return pair

    def _geometry_checked(self, block_size: int, num_blocks: int) -> bool:
        """Whether :meth:`check_cache_geometry` passed for this geometry in this step."""
        return (block_size, num_blocks) in self._checked_caches   # a set read: atomic

    def check_cache_geometry(self, what: str, block_size: int, num_blocks: int) -> None:
        """Every block a request reads exists in the table and in a cache of this geometry.

        Checked once per ``(block_size, num_blocks)`` per step (layers share the geometry)."""
        key = (block_size, num_blocks)
        with self._lock:
            if key in self._checked_caches:
                return
        width = int(self.block_table_cpu.shape[1])
        if self.batch:
            needed = (self.seq_lens_cpu.to(torch.int64) + block_size - 1) // block_size
            worst = int(torch.argmax(needed))
            if int(needed[worst]) > width:
                raise ValueError(
                    f"{what}: block_table has {width} columns but request {worst} "
                    f"(seq_len {self.seq_lens_list[worst]}, block size {block_size}) needs "
                    f"{int(needed[worst])} blocks")
            used = torch.arange(width).unsqueeze(0) < needed.unsqueeze(1)
            bad = used & ((self.block_table_cpu < 0) | (self.block_table_cpu >= num_blocks))
            if bool(bad.any()):
                b, j = (int(x) for x in bad.nonzero()[0])
                raise ValueError(
                    f"{what}: block_table[{b}, {j}] = {int(self.block_table_cpu[b, j])} is "
                    f"out of range for a cache of {num_blocks} blocks (request {b} reads "
                    f"blocks 0..{int(needed[b]) - 1} of its row)")
        with self._lock:
            self._checked_caches.add(key)


#: The decode metadata's old name (it was the private checked form; it is the public type now).
DecodeMetadata = MLADecodeMetadata
