"""CPU_MLA_SPARSE decode: DeepSeek Sparse Attention's decode on the native CPU kernel.

A sparse-only backend (``supports_dense = False``, as TORCH_SPARSE): ``run_sparse_decode``
attends each query row to the cache slots its indices name through
:meth:`app.backends.cpu.sparse_kernel.NativeSparseKernel.attend` (the paged cache read in place,
each named row loaded once for every head, AVX512-BF16 dot products for a bf16 cache where the
CPU has them). Same semantics as TORCH_SPARSE (``-1`` padding, repeats counted, a row naming
nothing out 0 and LSE ``-inf``); bf16 / fp16 / fp32 caches, any block size, ``query_len``
1..16, ``kv_lora_rank`` a multiple of 64 and ``qk_rope_head_dim`` of 32 (DeepSeek: 512, 64).
Unavailable (no AVX-512, no C compiler, ``APP_CPU_NATIVE_KERNEL=0``), it says why and the
selector takes TORCH_SPARSE.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from app._types import NO_GPU, ComputeCapabilities, DeviceCapability, MLADimensions
from app.backends.cpu.decode_kernel import has_bf16_dot
from app.backends.cpu.sparse_kernel import (
    NativeSparseKernel,
    load_sparse_kernel,
    sparse_kernel_status,
    sparse_kernel_unavailable_reason,
)
from app.backends.decode.base import MLASparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.workspaces import WorkspaceSource

__all__ = ["CpuSparseDecodeBackend"]


class CpuSparseDecodeBackend(MLASparseDecodeBackend):
    """Sparse absorbed MLA decode on the CPU through the native kernel (see the module)."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16, torch.float16, torch.float32)
    #: A CPU backend: never on a GPU.
    compute_capabilities: ClassVar[ComputeCapabilities] = NO_GPU
    #: Whether the native sparse kernels build, load and pass their self-test here.
    probe = staticmethod(lambda: sparse_kernel_status().available)

    @classmethod
    def supports_mla_dimensions(cls, dims: MLADimensions) -> bool:
        """``kv_lora_rank`` a multiple of 64 and ``qk_rope_head_dim`` of 32."""
        rank, rope = dims.latent_head_dims
        return rank % 64 == 0 and rank > 0 and rope % 32 == 0

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why the native sparse kernel is unusable (no AVX-512, no compiler, switched off)."""
        return sparse_kernel_unavailable_reason()

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int,
                 kv_cache_dtype: torch.dtype, *,
                 device_capability: DeviceCapability | None = None,
                 workspaces: WorkspaceSource | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype,
                         device_capability=device_capability, workspaces=workspaces)
        if not self.supports_mla_dimensions(MLADimensions(kv_lora_rank=kv_lora_rank,
                                                          qk_rope_head_dim=qk_rope_head_dim)):
            raise ValueError(f"{type(self).__name__}: kv_lora_rank must be a multiple of 64 "
                             f"and qk_rope_head_dim of 32, got {kv_lora_rank} and "
                             f"{qk_rope_head_dim}")
        self._kernel: tuple[NativeSparseKernel, bool] | None = None

    def _kernel_and_dot(self) -> tuple[NativeSparseKernel, bool]:
        """The kernel and whether bf16 runs on dot products, looked up at the first run."""
        found = self._kernel
        if found is None:
            kernel = load_sparse_kernel()
            if kernel is None:
                raise ValueError(self.unavailable_reason())
            found = self._kernel = (kernel, has_bf16_dot())
        return found

    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> None:
        if q.device.type != "cpu":
            raise ValueError(f"{type(self).__name__}: expected CPU tensors, got {q.device}")
        kernel, dot = self._kernel_and_dot()
        # indices is the base's private checked copy (check_sparse_indices), never the caller's
        # tensor, and out shares memory with no input: the kernel reads unchecked pointers.
        rows = metadata.batch * metadata.query_len
        q_rows = q.reshape(rows, self.num_heads, self.head_dim)
        if q_rows.stride(-1) != 1:
            q_rows = q_rows.contiguous()
        kernel.attend(q_rows, kv_cache, int(kv_cache.shape[1]), indices.view(rows, -1),
                      self.kv_lora_rank, out.view(rows, self.num_heads, self.kv_lora_rank),
                      None if lse is None else lse.view(rows, self.num_heads), softmax_scale,
                      k_scale, bf16_dot=dot and kv_cache.dtype == q.dtype == torch.bfloat16)
