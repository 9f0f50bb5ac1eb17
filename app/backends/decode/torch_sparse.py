"""TORCH_SPARSE decode: DeepSeek Sparse Attention's decode in plain torch, on any device.

A sparse-only backend (``supports_dense = False``): ``run_sparse_decode`` attends each query row
to the cache slots its indices name (``app.backends.sparse.sparse_attention_rows``: the named
latent rows gathered, float32 math); ``run_decode`` is refused. The reference a native sparse
kernel is compared with, and the fallback where none runs.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.sparse.attention import sparse_attention_rows

__all__ = ["TorchSparseDecodeBackend"]


class TorchSparseDecodeBackend(MLADecodeBackend):
    """Sparse absorbed MLA decode in plain torch: any device, any block size, fp16/bf16/fp32
    caches; ``out [B, query_len, H, kv_lora_rank]`` in q's dtype and the natural-log LSE."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float32)
    supports_dense: ClassVar[bool] = False
    supports_sparse: ClassVar[bool] = True

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        """Never called: the base refuses dense calls to a sparse-only backend."""
        raise NotImplementedError("TORCH_SPARSE runs sparse attention only")

    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> None:
        rows = metadata.batch * metadata.query_len
        o, lg = sparse_attention_rows(
            q.reshape(rows, self.num_heads, self.head_dim), kv_cache.reshape(-1, self.head_dim),
            indices.view(rows, -1), self.kv_lora_rank, softmax_scale * k_scale, k_scale)
        out.copy_(o.view(out.shape))
        if lse is not None:
            lse.copy_(lg.view(lse.shape))
