"""Input checks of the MLA decode contract, shared by every decode backend.

``check_decode_inputs`` checks each ``run_decode`` call's tensors against the step
(``MLADecodeMetadata``), before any kernel runs: ``q``'s shape, dtype and device, the cache's
width, dtype, device and strides, a caller's ``out=``, and the cache's geometry against the
block table (once per step and geometry). Every failure is a ``ValueError`` (``TypeError`` for a
non-tensor) naming the expected and actual value.
"""

from __future__ import annotations

import torch

from app._validation import check_dense, check_writable_out
from app.backends.decode.metadata import MLADecodeMetadata

__all__ = ["check_decode_inputs"]

_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_out(what: str, out: object, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    check_writable_out(f"{what}: out", out)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{what}: out must have shape {list(shape)} dtype {dtype} on "
                         f"{device}, got shape {list(out.shape)} dtype {out.dtype} on "
                         f"{out.device}")


def _inputs_pass(meta: MLADecodeMetadata, q: object, kv_cache: object,
                 q_shape: tuple[int, int, int, int], kv_cache_dtype: torch.dtype,
                 width: int | None = None) -> bool:
    """Whether ``check_decode_inputs`` (without ``out``) would pass, in one expression: True
    only where each of its checks holds (the cache geometry checked for this step already);
    anything else goes through them for the message."""
    tensor, strided = torch.Tensor, torch.strided
    if not (isinstance(q, tensor) and isinstance(kv_cache, tensor)):
        return False
    where, kv_shape = q.device, kv_cache.shape
    return (q.shape == q_shape and q.dtype in _Q_DTYPES and len(kv_shape) == 3
            and kv_shape[2] == (q_shape[3] if width is None else width) and kv_shape[1] >= 1
            and kv_cache.dtype == kv_cache_dtype and kv_cache.device == where
            and where.type != "meta" and q.layout == strided and kv_cache.layout == strided
            and kv_cache.stride(2) == 1
            and meta._geometry_checked(int(kv_shape[1]), int(kv_shape[0])))


def check_decode_inputs(what: str, meta: MLADecodeMetadata, q: object, kv_cache: object,
                        out: object, *, num_heads: int, kv_lora_rank: int,
                        qk_rope_head_dim: int, kv_cache_dtype: torch.dtype,
                        row_width: int | None = None) -> None:
    """Check one ``run_decode`` call's tensors against the step (``ValueError``).
    ``row_width``: the cache's last dim when it is not the latent dim (an ``fp8_ds_mla``
    cache: uint8 rows of 656 bytes at 512 + 64)."""
    head = kv_lora_rank + qk_rope_head_dim
    width = head if row_width is None else row_width
    if out is None and _inputs_pass(meta, q, kv_cache, (meta.batch, meta.query_len, num_heads,
                                                         head), kv_cache_dtype, width):
        return   # every check below passes: the common call costs a few comparisons
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
    if kv_cache.dim() != 3 or kv_cache.shape[2] != width or kv_cache.shape[1] < 1:
        row = ("kv_lora_rank + qk_rope_head_dim" if width == head else
               "bytes of an fp8_ds_mla row")
        raise ValueError(f"{what}: kv_cache must be [num_blocks, block_size, "
                         f"{width}] (one latent KV head, {row}), "
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
