"""CPU_MLA: absorbed MLA decode through our native AVX-512 kernel.

The kernel and its bindings live beside the prefill kernel's, in
:mod:`app.backends.cpu.decode_kernel` (its docstring: what it reads, how it splits the step
across threads, its memory); this module is the backend that runs it, and re-exports the
kernel's names from there. bf16 / fp16 / fp32 caches and the FP8 ones (``fp8`` / ``fp8_e4m3``
with the layer's scale, DeepSeek's ``fp8_ds_mla`` row), any block size, ``query_len`` 1..16
(causal inside the step), ``kv_lora_rank`` a multiple of 64 and ``qk_rope_head_dim`` a multiple
of 32 (DeepSeek: 512 and 64); the step's work split is planned once per step
(``_prepare_step``) and reused by every layer.

bf16 steps (a bf16 cache and q) run on AMX-BF16 tiles where the CPU has them and the AMX
build passes its self-tests (:mod:`app.backends.cpu.decode_kernel_amx`), on the AVX512-BF16
dot products elsewhere (FP8 caches with a bf16 q too), on float32 FMAs with
``APP_CPU_DECODE_BF16_DOT=0`` (neither tiles nor dot products then);
:meth:`CpuMLADecodeBackend.kernel_path` says which, and why, by the rule the backend applies
(:func:`app.backends.cpu.kernel_paths.decode_unit`).

Built, cached and self-tested by ``app.backends.cpu.loader`` on first use;
``APP_CPU_NATIVE_KERNEL=0`` turns it off (as for the prefill kernel). Unavailable (no
AVX-512, no C compiler, switched off), it says why and the selector takes TORCH_SDPA.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import torch

from app._types import NO_GPU, ComputeCapabilities, DeviceCapability, MLADimensions
from app.backends.cpu.decode_kernel import (
    BF16_DOT_ENV,
    SPEC,
    SPEC_OPENMP,
    DecodePlan,
    MlaDecodeArgs,
    NativeMLADecodeKernel,
    decode_kernel_status,
    has_bf16_dot,
    load_decode_kernel,
    plan_decode,
)
from app.backends.cpu.decode_kernel_amx import load_amx_decode_kernel
from app.backends.cpu.kernel_paths import (
    AMX_TILES,
    BF16_DOT,
    decode_kernel_path,
    decode_unit,
    tiles_may_run,
)
from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.workspaces import WorkspaceSource

__all__ = ["BF16_DOT_ENV", "SPEC", "SPEC_OPENMP", "CpuMLADecodeBackend", "DecodePlan",
           "MlaDecodeArgs", "NativeMLADecodeKernel", "decode_kernel_status", "has_bf16_dot",
           "load_decode_kernel", "plan_decode"]


class CpuMLADecodeBackend(MLADecodeBackend):
    """MLA decode on the CPU through the native AVX-512 kernel (see the module docstring)."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16, torch.float16, torch.float32)
    #: FP8 caches are read as stored (``cpu/csrc/mla_decode_cpu_fp8.h``: each chunk of keys
    #: dequantised once into a per-thread tile): e4m3 with the layer's scale, and DeepSeek's
    #: fp8_ds_mla row (656 bytes at 512 + 64; ``kv_lora_rank`` a multiple of 128).
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "fp8", "fp8_e4m3", "fp8_ds_mla")

    #: A CPU backend: never on a GPU.
    compute_capabilities: ClassVar[ComputeCapabilities] = NO_GPU
    #: Whether the native kernel builds, loads and passes its self-test here.
    probe = staticmethod(lambda: decode_kernel_status()[0].available)

    @classmethod
    def supports_mla_dimensions(cls, dims: MLADimensions) -> bool:
        """``kv_lora_rank`` a multiple of 64 and ``qk_rope_head_dim`` of 32."""
        rank, rope = dims.latent_head_dims
        return rank % 64 == 0 and rank > 0 and rope % 32 == 0

    @classmethod
    def kernel_path(cls, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
        """Which kernel path a ``dtype`` model (its q) with a ``kv_cache_dtype`` cache
        (``"auto"``: the model's dtype; ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_ds_mla"``) runs on
        here, and why (AMX tiles, AVX512-BF16 dot products or float32 FMAs), by the rule a
        backend's first step applies (``kernel_paths.decode_unit``): ``python -m app
        backends`` and the selector's explanation show it."""
        return decode_kernel_path(dtype, kv_cache_dtype)

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why the native kernel is unusable (no AVX-512, no compiler, switched off ...)."""
        return "native CPU decode kernel unavailable: " + "; ".join(
            decode_kernel_status()[0].reasons)

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int,
                 kv_cache_dtype: torch.dtype | str, *,
                 device_capability: DeviceCapability | None = None,
                 workspaces: WorkspaceSource | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype,
                         device_capability=device_capability, workspaces=workspaces)
        if not self.supports_mla_dimensions(MLADimensions(kv_lora_rank=kv_lora_rank,
                                                          qk_rope_head_dim=qk_rope_head_dim)):
            raise ValueError(f"{type(self).__name__}: kv_lora_rank must be a multiple of 64 "
                             f"and qk_rope_head_dim of 32, got {kv_lora_rank} and "
                             f"{qk_rope_head_dim}")
        self._plans: tuple[MLADecodeMetadata, int, DecodePlan] | None = None
        self._plan_lock = threading.Lock()
        # (q dtype, cache dtype) -> (kernel, bf16_dot): one entry per kind of step
        self._kernels: dict[tuple[torch.dtype, torch.dtype],
                            tuple[NativeMLADecodeKernel, bool]] = {}

    def _kernel_and_dot(self, q_dtype: torch.dtype, cache_dtype: torch.dtype
                        ) -> tuple[NativeMLADecodeKernel, bool]:
        """The kernel a step of these dtypes runs on and its ``bf16_dot`` flag, chosen by
        ``kernel_paths.decode_unit`` (the rule ``kernel_path`` reports) at this backend's
        first such step and kept: the lookup (the loader's switch checks and locks) took
        ~3 us, on every layer of every step. A backend made after a switch changes sees it;
        one already running keeps what it started with."""
        key = (q_dtype, cache_dtype)
        found = self._kernels.get(key)
        if found is None:
            kernel = load_decode_kernel()
            if kernel is None:
                raise ValueError(self.unavailable_reason())
            fmt = self.kv_cache_format
            amx = load_amx_decode_kernel() if tiles_may_run(q_dtype, cache_dtype, fmt) else None
            unit = decode_unit(q_dtype, cache_dtype, fmt, amx=amx is not None,
                               bf16_dot=has_bf16_dot())
            # the AMX kernel has the same interface; bf16_dot means nothing to it
            found = self._kernels[key] = ((amx if unit == AMX_TILES and amx else kernel),
                                          unit == BF16_DOT)
        return found

    def _plan_for(self, metadata: MLADecodeMetadata) -> DecodePlan:
        workers = torch.get_num_threads()
        with self._plan_lock:
            cached = self._plans
            if cached is not None and cached[0] is metadata and cached[1] == workers:
                return cached[2]
            plan = plan_decode(metadata.seq_lens_list, workers)
            self._plans = (metadata, workers, plan)
            return plan

    def _prepare_step(self, metadata: MLADecodeMetadata) -> None:
        """Plan the step's work split now (every layer reuses it)."""
        self._plan_for(metadata)

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        if q.device.type != "cpu":
            raise ValueError(f"{type(self).__name__}: expected CPU tensors, got {q.device}")
        kernel, dot = self._kernel_and_dot(q.dtype, kv_cache.dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        kernel.run(self._plan_for(metadata), q, kv_cache, metadata.block_table_cpu,
                   metadata.seq_lens_cpu, self.kv_lora_rank, out, lse, softmax_scale, k_scale,
                   bf16_dot=dot, kv_cache_format=self.kv_cache_format)
