"""Input checks of the MLA decode contract, shared by every decode backend.

A decode kernel reads the paged cache through the block table, so a block table too narrow for
``seq_lens``, a block id out of range or a query whose batch does not match the table would be
an out-of-bounds read. ``DecodeMetadata.build`` checks the step's layout once and keeps its own
int32 host snapshots: never the caller's tensors, so a caller that reuses (rewrites) its
buffers between two layers of a step cannot change what was checked; int64 values that do not
fit int32 are refused, never narrowed (``2**32 + 3`` would otherwise read block 3).
``check_decode_inputs`` checks each call's tensors against it, before any kernel runs. Every
failure is a ``ValueError`` (``TypeError`` for a non-tensor) naming the expected and actual value.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import attrs
import torch

from app._validation import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    check_dense,
    check_writable_out,
    is_int,
)

__all__ = [
    "DecodeMetadata",
    "check_decode_inputs",
    "check_positive_scale",
    "check_query_len",
    "host_int32_snapshot",
]

_INT_DTYPES = (torch.int32, torch.int64)
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_positive_scale(what: str, value: object) -> float:
    """``value`` as a float if it is a real number > 0 within float32's normal range, else
    ``ValueError``.

    A one-element floating tensor is accepted (its value is read on the host)."""
    if isinstance(value, torch.Tensor):
        check_dense(what, value)
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{what} must be a finite float > 0 or a one-element float "
                             f"tensor, got a tensor of shape {list(value.shape)} "
                             f"dtype {value.dtype}")
        value = float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a finite float > 0, got {value!r} "
                         f"({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not math.isfinite(number) or not number > 0:
        raise ValueError(f"{what} must be a finite float > 0, got {value!r}")
    if not FLOAT32_TINY <= number <= FLOAT32_MAX:
        raise ValueError(f"{what} must be within float32's normal range [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX:.4g}] (the kernels multiply in float32), got {value!r}")
    return number


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
class DecodeMetadata:
    """One decode step's layout, shared by every layer of the step.

    ``block_table`` int32 ``[B, max_blocks]`` and ``seq_lens`` int32 ``[B]`` as given (any
    device; read for their device only) with int32 contiguous host snapshots (``*_cpu``,
    copies taken and checked at ``build``: what every kernel reads); ``query_len`` the uniform
    number of new tokens per request. ``seq_lens`` counts those new tokens (already in the
    cache).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    block_table_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    query_len: int
    seq_lens_list: tuple[int, ...]
    max_seq_len: int
    _device_copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = attrs.field(
        factory=dict, repr=False)
    _checked_caches: set[tuple[int, int]] = attrs.field(factory=set, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    @property
    def batch(self) -> int:
        """The number of requests B."""
        return len(self.seq_lens_list)

    @classmethod
    def build(cls, what: str, block_table: object, seq_lens: object, query_len: object,
              max_query_len: int) -> DecodeMetadata:
        """Check the step's layout (``ValueError``/``TypeError``) and keep host copies."""
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
        return cls(block_table=bt, seq_lens=sl,
                   block_table_cpu=host_int32_snapshot(f"{what}: block_table", bt),
                   seq_lens_cpu=sl_cpu, query_len=qlen, seq_lens_list=lens,
                   max_seq_len=max(lens, default=0))

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


def _check_out(what: str, out: object, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    check_writable_out(f"{what}: out", out)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{what}: out must have shape {list(shape)} dtype {dtype} on "
                         f"{device}, got shape {list(out.shape)} dtype {out.dtype} on "
                         f"{out.device}")


def check_decode_inputs(what: str, meta: DecodeMetadata, q: object, kv_cache: object,
                        out: object, *, num_heads: int, kv_lora_rank: int,
                        qk_rope_head_dim: int, kv_cache_dtype: torch.dtype) -> None:
    """Check one ``run_decode`` call's tensors against the step (``ValueError``)."""
    head = kv_lora_rank + qk_rope_head_dim
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{what}: q must be a torch.Tensor, got {type(q).__name__}")
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{what}: kv_cache must be a torch.Tensor, got "
                        f"{type(kv_cache).__name__}")
    check_dense(f"{what}: q", q)
    check_dense(f"{what}: kv_cache", kv_cache)
    expected_q = (meta.batch, meta.query_len, num_heads, head)
    if tuple(q.shape) != expected_q:
        raise ValueError(f"{what}: q must be [B, query_len, H, kv_lora_rank + "
                         f"qk_rope_head_dim] = {list(expected_q)} (B and query_len from "
                         f"prepare_metadata), got {list(q.shape)}")
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"{what}: q dtype must be one of {list(_Q_DTYPES)}, got {q.dtype}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != head or kv_cache.shape[1] < 1:
        raise ValueError(f"{what}: kv_cache must be [num_blocks, block_size, "
                         f"{head}] (one latent KV head, kv_lora_rank + qk_rope_head_dim), "
                         f"got {list(kv_cache.shape)}")
    if kv_cache.dtype != kv_cache_dtype:
        raise ValueError(f"{what}: kv_cache dtype must be {kv_cache_dtype} (the backend's "
                         f"kv_cache_dtype), got {kv_cache.dtype}")
    if kv_cache.device != q.device:
        raise ValueError(f"{what}: kv_cache is on {kv_cache.device} but q is on {q.device}")
    if kv_cache.stride(2) != 1:
        raise ValueError(f"{what}: kv_cache rows must have unit stride in the last dim, got "
                         f"strides {list(kv_cache.stride())}")
    if out is not None:
        _check_out(what, out, (meta.batch, meta.query_len, num_heads, kv_lora_rank),
                   q.dtype, q.device)
    meta.check_cache_geometry(what, int(kv_cache.shape[1]), int(kv_cache.shape[0]))
