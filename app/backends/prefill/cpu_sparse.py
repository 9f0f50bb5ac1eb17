"""CPU_MLA_SPARSE prefill: DeepSeek Sparse Attention's prefill on the native CPU kernel.

A sparse-only backend (``supports_dense = False``, as TORCH_SPARSE): ``run_sparse_prefill``
attends each query row, in the absorbed form, to the latent rows its indices name through
:meth:`app.backends.cpu.sparse_kernel.NativeSparseKernel.attend` (the rows of ``kv`` read in
place, each loaded once for every head; AVX512-BF16 dot products for bf16 where the CPU has
them). A context read in chunks is one call per chunk, merged by LSE by the caller, as the verb
defines. Same semantics as TORCH_SPARSE; fp16/bf16/fp32, ``kv_lora_rank`` a multiple of 64 and
``qk_rope_head_dim`` of 32. Unavailable (no AVX-512, no C compiler,
``APP_CPU_NATIVE_KERNEL=0``), it says why and the selector takes TORCH_SPARSE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from app._types import NO_GPU, ComputeCapabilities, DeviceCapability, MLADimensions
from app.backends.cpu.decode_kernel import has_bf16_dot
from app.backends.cpu.sparse_kernel import (
    load_sparse_kernel,
    sparse_kernel_status,
    sparse_kernel_unavailable_reason,
)
from app.backends.prefill.base import MLASparsePrefillBackend

if TYPE_CHECKING:
    from app.backends.workspaces import KernelWorkspaces
    from app.config import EngineConfig

__all__ = ["CpuSparsePrefillBackend"]


class CpuSparsePrefillBackend(MLASparsePrefillBackend):
    """Sparse absorbed MLA prefill on the CPU through the native kernel (see the module):
    ``out [T, H, kv_lora_rank]`` in q's dtype (``out=`` written in place) and the LSE."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float32)
    supports_out: ClassVar[bool] = True
    #: A CPU backend: never on a GPU.
    compute_capabilities: ClassVar[ComputeCapabilities] = NO_GPU
    #: Whether the native sparse kernels build, load and pass their self-test here.
    probe = staticmethod(lambda: sparse_kernel_status().available)

    @classmethod
    def supports_mla_dimensions(cls, dims: MLADimensions) -> bool:
        """``kv_lora_rank`` a multiple of 64 (or not given: 0) and ``qk_rope_head_dim`` of 32."""
        rank, rope = dims.latent_head_dims
        return rank % 64 == 0 and rope % 32 == 0

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why the native sparse kernel is unusable (no AVX-512, no compiler, switched off)."""
        return sparse_kernel_unavailable_reason()

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, config, device_capability=device_capability,
                         workspaces=workspaces)
        if kv_lora_rank % 64 or kv_lora_rank < 1 or qk_rope_head_dim % 32:
            raise ValueError(f"{type(self).__name__}: kv_lora_rank must be a positive multiple "
                             f"of 64 and qk_rope_head_dim a multiple of 32, got {kv_lora_rank} "
                             f"and {qk_rope_head_dim}")

    def _run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                            k_scale: float) -> None:
        if q.device.type != "cpu":
            raise ValueError(f"{type(self).__name__}: expected CPU tensors, got {q.device}")
        kernel = load_sparse_kernel()
        if kernel is None:
            raise ValueError(self.unavailable_reason())
        if q.stride(-1) != 1:
            q = q.contiguous()
        dot = q.dtype == kv.dtype == torch.bfloat16 and has_bf16_dot()
        # indices is the base's private checked copy (check_sparse_indices), never the caller's
        # tensor, and out shares memory with no input: the kernel reads unchecked pointers.
        kernel.attend(q, kv, 1, indices, self.kv_lora_rank, out, lse, softmax_scale, k_scale,
                      bf16_dot=dot)
