"""TORCH_SPARSE decode: DeepSeek Sparse Attention's decode in plain torch, on any device.

A sparse-only backend (``supports_dense = False``): ``run_sparse_decode`` attends each query row
to the cache slots its indices name (``app.backends.sparse.sparse_attention_rows``: the named
latent rows gathered, float32 math); ``run_decode`` is refused. The reference a native sparse
kernel is compared with, and the fallback where none runs. It reads the FP8 latent caches too
(``fp8`` / ``fp8_e4m3``, ``fp8_ds_mla``: each named row dequantised as it is gathered, as
TORCH_SDPA dequantises the rows it reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from app.backends.decode.base import MLASparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.sparse.attention import sparse_attention_rows
from app.kvcache.cache_dtypes import dequantize_fp8_ds_mla

__all__ = ["TorchSparseDecodeBackend"]


class TorchSparseDecodeBackend(MLASparseDecodeBackend):
    """Sparse absorbed MLA decode in plain torch: any device, any block size, fp16/bf16/fp32
    caches; ``out [B, query_len, H, kv_lora_rank]`` in q's dtype and the natural-log LSE."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float32)
    #: Every cache dtype: FP8 rows are dequantised to float32 as they are gathered.
    supported_kv_cache_dtypes: ClassVar[Sequence[str] | None] = (
        "auto", "fp8", "fp8_e4m3", "fp8_ds_mla")

    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> None:
        rows = metadata.batch * metadata.query_len
        rank, rope = self.kv_lora_rank, self.qk_rope_head_dim
        decode_rows = (None if self.kv_cache_format != "fp8_ds_mla" else
                       lambda stored: dequantize_fp8_ds_mla(stored, rank, rope))
        o, lg = sparse_attention_rows(
            q.reshape(rows, self.num_heads, self.head_dim),
            kv_cache.reshape(-1, self.kv_cache_row_width), indices.view(rows, -1),
            self.kv_lora_rank, softmax_scale * k_scale, k_scale, decode_rows=decode_rows)
        out.copy_(o.view(out.shape))
        if lse is not None:
            lse.copy_(lg.view(lse.shape))
