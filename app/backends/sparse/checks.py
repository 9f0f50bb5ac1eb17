"""Input checks of sparse attention, shared by both kinds' ``run_sparse_*`` verbs.

Sparse attention (DeepSeek Sparse Attention) names, per query row, the rows of a key/value tensor
it attends to: ``indices [..., topk]`` int32, each an index into the rows of ``kv`` (a paged
cache viewed flat, ``[num_blocks * block_size, D]``: slot ``block_id * block_size + offset``,
or rows gathered into a workspace), ``-1`` for padding. A kernel reads those rows directly, so an
index out of ``[-1, num_rows)`` would be an out-of-bounds read: ``check_sparse_indices`` refuses
it (one ``aminmax`` over the indices) before any kernel runs. It checks, and returns, a private
copy: the values checked are the values the kernel reads, whatever another thread does to the
caller's tensor during the call, and whatever the kernel writes into an ``out=`` that shares
memory with it.
"""

from __future__ import annotations

import attrs
import torch

from app._validation import FLOAT32_MAX, check_dense, check_writable_out
from app.backends.contract import check_attention_scale, check_return_flag, writes_in_place

__all__ = ["SparseRowsCall", "check_sparse_indices", "check_sparse_out", "check_sparse_rows"]


def check_sparse_indices(what: str, indices: object, rows: tuple[int, ...], num_kv_rows: int,
                         device: torch.device) -> torch.Tensor:
    """A private contiguous int32 copy of ``indices`` ``[*rows, topk]`` (``topk >= 1``) on
    ``device`` whose every value is in ``[-1, num_kv_rows)``; ``TypeError`` / ``ValueError``
    naming ``what``, the expected and the given value otherwise. The copy, never the caller's
    tensor, is what is checked and what a kernel must read (see the module docstring)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{what}: indices must be a torch.Tensor, got {type(indices).__name__}")
    check_dense(f"{what}: indices", indices)
    shape = [*rows, "topk"]
    if indices.dim() != len(rows) + 1 or tuple(indices.shape[:-1]) != rows \
            or indices.shape[-1] < 1:
        raise ValueError(f"{what}: indices must be {shape} with topk >= 1, got "
                         f"{list(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"{what}: indices must be int32 (rows of kv, -1 for padding), got "
                         f"{indices.dtype}")
    if indices.device != device:
        raise ValueError(f"{what}: indices are on {indices.device} but q is on {device}")
    # Copied before it is checked: a caller's tensor rewritten by another thread after the check
    # (or an out= over it written by the kernel) would be read out of range by a native kernel.
    # O(rows * topk) int32, never O(cache): cheap next to the attention it feeds.
    private = torch.empty(tuple(indices.shape), dtype=torch.int32, device=indices.device)
    private.copy_(indices)
    if private.numel():
        low, high = (int(x) for x in torch.aminmax(private))
        if low < -1 or high >= num_kv_rows:
            bad = ((private < -1) | (private >= num_kv_rows)).nonzero()[0].tolist()
            raise ValueError(f"{what}: indices{bad} = {int(private[tuple(bad)])} is out of "
                             f"range: every index must be a row of kv in [0, {num_kv_rows}) "
                             f"or -1 (padding)")
    return private


def check_sparse_rows(what: str, q: object, kv: object, *, num_heads: int, head_dim: int,
                      dtypes: tuple[torch.dtype, ...] | list[torch.dtype]) -> None:
    """``q [T, num_heads, head_dim]`` and ``kv [N, head_dim]`` (rows with unit stride in the last
    dim) of one dtype in ``dtypes`` on one device; ``TypeError`` / ``ValueError`` otherwise."""
    for name, t in (("q", q), ("kv", kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(f"{what}: {name}", t)
    if not isinstance(q, torch.Tensor) or not isinstance(kv, torch.Tensor):  # for mypy
        raise TypeError(f"{what}: q and kv must be tensors")
    if q.dim() != 3 or q.shape[1] != num_heads or q.shape[2] != head_dim:
        raise ValueError(f"{what}: q must be [T, {num_heads}, {head_dim}] (H heads of "
                         f"kv_lora_rank + qk_rope_head_dim), got {list(q.shape)}")
    if kv.dim() != 2 or kv.shape[1] != head_dim:
        raise ValueError(f"{what}: kv must be [N, {head_dim}] (one latent row per token), got "
                         f"{list(kv.shape)}")
    if q.dtype not in dtypes:
        raise ValueError(f"{what}: q dtype must be one of {list(dtypes)}, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{what}: kv dtype must be q's ({q.dtype}), got {kv.dtype}")
    if kv.device != q.device:
        raise ValueError(f"{what}: kv is on {kv.device} but q is on {q.device}")
    if kv.numel() and kv.stride(1) != 1:
        raise ValueError(f"{what}: kv rows must have unit stride in the last dim, got strides "
                         f"{list(kv.stride())}")


def check_sparse_out(what: str, out: object, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> None:
    """A caller's ``out=``: a writable tensor of ``shape``, ``dtype`` on ``device``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    check_writable_out(f"{what}: out", out)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{what}: out must have shape {list(shape)} dtype {dtype} on {device}, "
                         f"got shape {list(out.shape)} dtype {out.dtype} on {out.device}")


@attrs.frozen(eq=False)
class SparseRowsCall:
    """One sparse call over latent rows (``run_sparse_prefill``), checked: its inputs (the
    indices a private checked copy), scales, the tensor the kernel writes (``target``: the
    caller's ``out=`` when it shares memory with no input, the caller's indices included) and
    the token-major LSE ``[T, H]`` to fill (None when not asked for)."""

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    target: torch.Tensor
    lse: torch.Tensor | None
    softmax_scale: float
    k_scale: float

    @property
    def rows(self) -> int:
        """Query rows ``T``."""
        return int(self.q.shape[0])

    @classmethod
    def check(cls, what: str, q: object, kv: object, indices: object, out: object,
              softmax_scale: object, k_scale: object, return_softmax_lse: object, *,
              num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int,
              dtypes: tuple[torch.dtype, ...]) -> SparseRowsCall:
        """Every check of the call (``TypeError`` / ``ValueError`` naming ``what``)."""
        want = check_return_flag(what, "return_softmax_lse", return_softmax_lse)
        scale = check_attention_scale(what, "softmax_scale", softmax_scale, tensor_ok=True)
        kscale = 1.0 if k_scale is None else check_attention_scale(
            what, "k_scale", k_scale, upper=FLOAT32_MAX, tensor_ok=True)
        check_sparse_rows(what, q, kv, num_heads=num_heads,
                          head_dim=kv_lora_rank + qk_rope_head_dim, dtypes=dtypes)
        if not isinstance(q, torch.Tensor) or not isinstance(kv, torch.Tensor):  # for mypy
            raise TypeError(f"{what}: q and kv must be tensors")
        idx = check_sparse_indices(what, indices, (int(q.shape[0]),), int(kv.shape[0]),
                                   q.device)
        shape = (int(q.shape[0]), num_heads, kv_lora_rank)
        if out is not None:
            check_sparse_out(what, out, shape, q.dtype, q.device)
        q, kv = q.resolve_neg(), kv.resolve_neg()
        in_place = isinstance(out, torch.Tensor) and isinstance(indices, torch.Tensor) \
            and writes_in_place(out, (q, kv, indices, idx))
        target = out if in_place and isinstance(out, torch.Tensor) else torch.empty(
            shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(shape[:2], dtype=torch.float32, device=q.device) if want else None
        return cls(q, kv, idx, target, lse, scale, kscale)

    def result(self, out: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor,
                                                                      torch.Tensor]:
        """What the verb returns: the output (the caller's ``out=``, written after the kernel
        when it shared memory with an input) and, when asked for, the LSE head-major."""
        target = self.target
        if out is not None and target is not out:
            out.copy_(target)
            target = out
        return target if self.lse is None else (target, self.lse.t().contiguous())
