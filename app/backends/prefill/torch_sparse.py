"""TORCH_SPARSE prefill: DeepSeek Sparse Attention's prefill in plain torch, on any device.

A sparse-only backend (``supports_dense = False``): ``run_sparse_prefill`` attends each query
row, in the absorbed form, to the latent rows its indices name
(``app.backends.sparse.sparse_attention_rows``: float32 math, a bounded chunk of rows gathered at
a time); the dense verbs are refused. The reference a native sparse kernel is compared with.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from app.backends.prefill.base import MLASparsePrefillBackend
from app.backends.sparse.attention import sparse_attention_rows

__all__ = ["TorchSparsePrefillBackend"]


class TorchSparsePrefillBackend(MLASparsePrefillBackend):
    """Sparse absorbed MLA prefill in plain torch: fp16/bf16/fp32, any device;
    ``out [T, H, kv_lora_rank]`` in q's dtype (``out=`` written in place) and the LSE."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float32)
    supports_out: ClassVar[bool] = True

    def _run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                            k_scale: float) -> None:
        o, lg = sparse_attention_rows(q, kv, indices, self.kv_lora_rank,
                                      softmax_scale * k_scale, k_scale)
        out.copy_(o)
        if lse is not None:
            lse.copy_(lg)
