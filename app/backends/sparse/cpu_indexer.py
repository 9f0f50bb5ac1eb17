"""The lightning indexer on the native CPU kernels, and the choice of an indexer for a platform.

``CpuSparseIndexer`` runs ``SparseIndexer.select``'s hook through
:meth:`app.backends.cpu.sparse_kernel.NativeSparseKernel.select`: the scores in C over the paged
key cache (read through the block table, a tile of keys shared by up to 8 rows and every head;
AVX512-BF16 dot products for bf16 keys and q where the CPU has them, float32 sums), then a
top-k in C that orders and ties exactly as :func:`app.backends.sparse.indexer.topk_positions`
(rows holding a non-finite score are ordered by ``topk_positions`` itself). CPU tensors only.

``default_sparse_indexer(platform)`` is what a container's ``sparse_indexer`` provider builds:
the CPU indexer on the CPU platform where its library builds, loads and passes its self-test,
else ``TorchSparseIndexer`` (the reason logged once at INFO).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, ClassVar

import torch

from app.backends.cpu.sparse_kernel import (
    load_sparse_kernel,
    sparse_kernel_status,
    sparse_kernel_unavailable_reason,
)
from app.backends.sparse.indexer import SparseIndexer, SparseIndexerMetadata, TorchSparseIndexer

if TYPE_CHECKING:
    from app.platforms.base import Platform

__all__ = ["CpuSparseIndexer", "default_sparse_indexer"]

logger = logging.getLogger(__name__)
_told = threading.Event()


class CpuSparseIndexer(SparseIndexer):
    """The indexer on the native CPU kernels (see the module); CPU tensors only
    (``ValueError`` otherwise), key caches of fp16 / bf16 / fp32."""

    name: ClassVar[str | None] = "CPU"
    #: Whether the native sparse kernels build, load and pass their self-test here.
    probe = staticmethod(lambda: sparse_kernel_status().available)

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why the native sparse kernels are unusable here."""
        return sparse_kernel_unavailable_reason()

    def _select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                metadata: SparseIndexerMetadata, out: torch.Tensor) -> None:
        if q.device.type != "cpu":
            raise ValueError(f"{type(self).__name__}.select: expected CPU tensors, got "
                             f"{q.device} (use TorchSparseIndexer off the CPU)")
        kernel = load_sparse_kernel()
        if kernel is None:
            raise ValueError(f"{type(self).__name__}.select: {self.unavailable_reason()}")
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            q = q.float()  # float64: the scores are float32 whatever q's dtype
        if q.stride(-1) != 1:
            q = q.contiguous()
        if key_cache.stride(-1) != 1:
            key_cache = key_cache.contiguous()
        kernel.select(q, weights.contiguous(), key_cache, metadata.block_table.contiguous(),
                      metadata.query_start, metadata.seq_lens, metadata.visible.contiguous(),
                      out)


def default_sparse_indexer(platform: Platform | None = None) -> SparseIndexer:
    """``CpuSparseIndexer`` on the CPU platform where the native kernels run, else
    ``TorchSparseIndexer`` (why is logged once at INFO)."""
    if platform is not None and platform.device_type == "cpu":
        if CpuSparseIndexer.is_available():
            return CpuSparseIndexer()
        if not _told.is_set():
            _told.set()
            logger.info("sparse indexer: TORCH (%s)", CpuSparseIndexer.unavailable_reason())
    return TorchSparseIndexer()
