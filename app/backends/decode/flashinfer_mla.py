"""FLASHINFER_MLA: flashinfer's MLA decode kernels over the paged latent cache.

Which kernel runs is fixed by the GPU's compute capability, given at construction (never
queried at launch):

- **trtllm-gen** on Blackwell (SM100 / SM103 / SM107: the cubins' ``isSMCompatible``,
  ``flashinfer/data/include/flashinfer/trtllm/fmha/fmhaKernels.cuh:67``), through
  ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(backend="trtllm-gen")``. No plan:
  the step's device block table, ``seq_lens`` and ``max_seq_len`` are made once per step and
  every layer reuses them. It reads bf16 or FP8 (e4m3) query and cache of the same dtype
  (``mla/_batch_mla/_backends/trtllm_gen_backend.py:150``), writes bf16 (``mla/_core.py``
  checks ``out`` against ``torch.bfloat16``), takes cache blocks of 32 or 64 tokens only and
  no 65..127 heads (``mla/_core.py:4402-4410``); its workspace is zeroed when made and grows
  with the batch when the LSE is asked (``trtllm_gen_workspace_bytes``). Causal inside a
  multi-token step: flashinfer's own test checks it against the fa2 wrapper planned causal
  (``tests/attention/test_trtllm_gen_mla.py``).
- **fa3** on SM90 and **fa2** elsewhere (SM80+, and Blackwell with 65..127 heads), through
  ``flashinfer.mla.BatchMLAPagedAttentionWrapper(backend=...)``: planned once per step (CSR page
  metadata built on the host from the step's block table), reused by every layer. Any page
  size (``mla/_batch_mla/_planning.py:94``); query fp16/bf16 and a cache of the same dtype, or
  an FP8 cache with a bf16 query on SM90 only (``_backends/_fa_common.py:136-171``), the FP8
  dequantisation scales passed on every run (``ckv_scale``/``kpe_scale``).

The plan's softmax scale is part of what the plan is keyed on: a call with another
``softmax_scale`` (or, for a 16-bit cache, another ``k_scale``, folded into it) plans again
rather than reuse a stale one. An FP8 cache on trtllm-gen needs an FP8 query: it is quantised
per call and its scale folded into that call's ``bmm1_scale``; ``bmm2_scale`` is the call's
``k_scale`` (both as one-element device tensors, trtllm-gen's dynamic-scale form, so the
query's scale is never read on the host). The LSE is asked in natural log
(``return_lse_base="basee"`` / ``lse_mode="basee"``; both kernels write base 2 natively and
scale by ``1 / log2 e``, ``mla/_core.py:3535``). The wrapper's plan declares the LSE, so it is
always computed (into a scratch buffer when the caller wants none).

flashinfer-python is imported only when availability is asked or at first use; the argument
construction (``plan_kwargs``, ``run_kwargs``, ``trtllm_kwargs``) is kept apart from the launch
so that contract tests bind it to the installed package's signatures without a GPU. Not run on
a GPU in this project's CI; see docs/gpu-results.md.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from app._types import ComputeCapabilities, DeviceCapability, MLADimensions
from app._validation import check_int_at_least
from app.backends.decode._gpu import (
    check_query_dtype,
    check_workspaces,
    fp8_query_reasons,
    insert_reasons,
    quantize_query_fp8,
)
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.vendors import (
    FLASHINFER_CAPABILITIES,
    FLASHINFER_INSTALL_HINT,
    FLASHINFER_PACKAGE,
    TRTLLM_GEN_MLA_CAPABILITIES,
    FlashInferMLAKernels,
    probe_flashinfer_mla,
)
from app.backends.workspaces import WorkspaceSource

if TYPE_CHECKING:
    from app.config import EngineConfig

__all__ = [
    "FA2",
    "FA3",
    "TRTLLM_GEN",
    "TRTLLM_GEN_BLOCK_SIZES",
    "WORKSPACE_BYTES",
    "FlashInferMLADecodeBackend",
    "FlashInferMLAKernels",
    "causal_tiles_fit",
    "decode_kernel_for",
    "trtllm_gen_workspace_bytes",
]

TRTLLM_GEN, FA3, FA2 = "trtllm-gen", "fa3", "fa2"
#: Cache block sizes trtllm-gen MLA decode accepts (flashinfer/mla/_core.py:4409).
TRTLLM_GEN_BLOCK_SIZES = (32, 64)
#: Head counts trtllm-gen MLA decode refuses (flashinfer/mla/_core.py:4402).
_TRTLLM_GEN_HEAD_GAP = range(65, 128)
#: Cache dtypes each kernel reads (see the module docstring for the sources).
_KERNEL_CACHE_DTYPES = {
    TRTLLM_GEN: (torch.bfloat16, torch.float8_e4m3fn),
    FA3: (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
    FA2: (torch.float16, torch.bfloat16),
}
#: flashinfer's suggested starting size for the MLA workspaces (the wrapper's docstring).
WORKSPACE_BYTES = 128 * 1024 * 1024
#: The names of this backend's workspaces in a shared ``WorkspaceSource``.
WORKSPACE_TRTLLM_GEN, WORKSPACE_WRAPPER = "flashinfer_mla.trtllm_gen", "flashinfer_mla.wrapper"
#: Only the SM120 sparse backend reads it ("TODO: remove in 1.0?", mla/_core.py:4863);
#: DeepSeek's no-rope query width, as vLLM passes.
_QK_NOPE_HEAD_DIM = 128


#: flashinfer's MLA decode entry points, or None (``app.backends.vendors``; tests swap it here).
_probe = probe_flashinfer_mla


def trtllm_gen_workspace_bytes(batch: int, query_len: int, num_heads: int,
                               with_lse: bool) -> int:
    """The trtllm-gen workspace one call needs: the split-KV scratch (128 MiB, flashinfer's
    usual size) and, when the LSE is asked, the softmax-stats slab the launcher carves out
    first: ``8 * H * B * round_up(query_len, 256)`` bytes plus a 1 MiB guard
    (``csrc/trtllm_fmha_kernel_launcher.cu:343-359``); it grows with the batch."""
    if not with_lse:
        return WORKSPACE_BYTES
    slab = 8 * num_heads * batch * (-(-query_len // 256) * 256)
    return WORKSPACE_BYTES + slab + (1 << 20) + 16


def causal_tiles_fit(num_heads: int, query_len: int) -> bool:
    """Whether the fa2/fa3 MLA kernels' query tile holds whole query rows of every head.

    With a causal multi-token step, flashinfer refuses a plan in which a query tile ends
    inside a row's heads at a KV-tile boundary ("native execution would omit a visible key",
    ``mla/_batch_mla/_backends/_fa_common.py:325-358``); the tile is 64 rows, or 128 when
    ``query_len * num_heads > 64``, so a head count that divides it never hits that."""
    if query_len == 1:
        return True  # planned non-causal: one row per request sees its whole sequence
    tile = 128 if query_len * num_heads > 64 else 64
    return tile % num_heads == 0


def decode_kernel_for(capability: DeviceCapability, num_heads: int) -> str:
    """The flashinfer kernel for a GPU and head count: trtllm-gen (Blackwell, unless 65..127
    heads), fa3 (SM90), fa2 (everything else from SM80)."""
    if capability in TRTLLM_GEN_MLA_CAPABILITIES and num_heads not in _TRTLLM_GEN_HEAD_GAP:
        return TRTLLM_GEN
    return FA3 if capability.major == 9 else FA2


#: What a plan is keyed on: device, page size, query dtype, softmax scale (a plain tuple:
#: compared on every layer's call).
_PlanKey = tuple[torch.device, int, torch.dtype, float]


class FlashInferMLADecodeBackend(MLADecodeBackend):
    """flashinfer MLA decode: trtllm-gen on Blackwell, the paged MLA wrapper (fa3 on SM90,
    fa2 elsewhere) with one plan per step."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float8_e4m3fn)
    #: Any block size for fa2/fa3; trtllm-gen narrows it (``block_sizes_for``).
    supported_block_sizes: ClassVar[tuple[int, ...]] = ()
    supported_mla_dimensions: ClassVar[tuple[MLADimensions, ...]] = (
        MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64),)
    requires_device_capability: ClassVar[bool] = True
    #: Whether the kernels need CUDA tensors (contract tests lift it to run stand-ins on CPU).
    requires_cuda: ClassVar[bool] = True
    #: No: inside a multi-token step the fa2/fa3 kernels mask a key past a row's diagonal on
    #: the scores only; the key's value is still loaded (it is below the request's length) and
    #: multiplied by its probability 0 over the whole KV tile, and 0 * NaN is NaN
    #: (``mla_hopper.cuh``: ``logits_mask_``; keys past the request's length are zero-filled
    #: at load). On an H100 a NaN in a step's last new token made all 4 rows of the request
    #: non-finite. trtllm-gen's behaviour has not been run; declared with the others.
    isolates_nonfinite_keys: ClassVar[bool] = False

    #: SM80 and newer (fa2); SM90 runs fa3, Blackwell trtllm-gen.
    compute_capabilities: ClassVar[ComputeCapabilities] = FLASHINFER_CAPABILITIES
    #: flashinfer's MLA decode entry points (late-bound: tests swap the module's ``_probe``).
    probe = staticmethod(lambda: _probe())
    kernel_package: ClassVar[str | None] = FLASHINFER_PACKAGE
    install_hint: ClassVar[str] = FLASHINFER_INSTALL_HINT
    #: e4m3 with one scale per layer (``ckv_scale``/``kpe_scale``, trtllm-gen's bmm scales):
    #: trtllm-gen and fa3 (the dtype slot refuses fa2). See ``kv_cache_dtype_notes``.
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8", "fp8_e4m3")
    kv_cache_dtype_notes: ClassVar[dict[str, str]] = {
        "fp8_ds_mla": "flashinfer 0.7.2 reads the 656-byte FlashMLA row only in its SM120 "
                      "sparse MLA kernels (DeepSeek-V3.2 top-k), not in the dense decode "
                      "this backend runs"}

    @classmethod
    def block_sizes_for(cls, device_capability: DeviceCapability, num_heads: int
                        ) -> tuple[int, ...]:
        """The cache block sizes the kernel for this GPU reads (empty: any)."""
        kernel = decode_kernel_for(device_capability, num_heads)
        return TRTLLM_GEN_BLOCK_SIZES if kernel == TRTLLM_GEN else ()

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLADecodeSelectorConfig) -> list[str]:
        """The base class's reasons plus the kernel's own (dtype, block size) on this GPU."""
        if device_capability is None or not cls.supports_compute_capability(device_capability):
            return super().validate_configuration(device_capability, selector_config)
        cfg = selector_config
        kernel = decode_kernel_for(device_capability, cfg.num_heads)
        cache_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype in ("fp8", "fp8_e4m3") \
            else cfg.dtype                                   # issue 36: an FP8 cache
        dtype = [] if not cls.supports_dtype(cfg.dtype) or cache_dtype in \
            _KERNEL_CACHE_DTYPES[kernel] else [
                f"dtype {cache_dtype} not supported by flashinfer's {kernel} MLA kernel on "
                f"SM{device_capability.to_int()} with {cfg.num_heads} heads (supported: "
                f"{[str(d) for d in _KERNEL_CACHE_DTYPES[kernel]]})"]
        sizes = cls.block_sizes_for(device_capability, cfg.num_heads)
        block = [] if not sizes or cfg.block_size in sizes else [
            f"block size {cfg.block_size} not supported by flashinfer's {kernel} MLA kernel "
            f"on SM{device_capability.to_int()} (supported: "
            f"{', '.join(str(s) for s in sizes)})"]
        reasons = insert_reasons(cls, device_capability, cfg,
                                 dtype=dtype + fp8_query_reasons(cfg), block_size=block)
        if kernel != TRTLLM_GEN and not causal_tiles_fit(cfg.num_heads, cfg.query_len):
            reasons.append(f"query_len {cfg.query_len} with {cfg.num_heads} heads not "
                           f"supported by flashinfer's {kernel} MLA kernel (its causal query "
                           f"tile must hold whole rows: a head count dividing 64)")
        return reasons

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int,
                 kv_cache_dtype: torch.dtype | str, *,
                 device_capability: DeviceCapability | None = None,
                 workspaces: WorkspaceSource | None = None,
                 block_size: int | None = None) -> None:
        """``device_capability`` picks the kernel (required); ``workspaces`` may be shared
        (the container's kernel workspaces; default: this instance's own ``KernelWorkspaces``);
        ``block_size``, when known, lets ``prepare_metadata`` plan at once (else the first
        layer's call plans)."""
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype,
                         device_capability=device_capability, workspaces=workspaces)
        name = type(self).__name__
        if device_capability is None:
            raise ValueError(f"{name}: device_capability is required (the GPU's compute "
                             f"capability picks trtllm-gen, fa3 or fa2)")
        if not self.supports_compute_capability(device_capability):
            raise ValueError(f"{name}: compute capability {device_capability} not supported "
                             f"(SM80 or newer)")
        if not self.supports_mla_dimensions(MLADimensions(kv_lora_rank=kv_lora_rank,
                                                          qk_rope_head_dim=qk_rope_head_dim)):
            raise ValueError(f"{name}: (kv_lora_rank, qk_rope_head_dim) must be one of "
                             f"{list(self.supported_head_dims)}, got "
                             f"({kv_lora_rank}, {qk_rope_head_dim})")
        self.kernel = decode_kernel_for(device_capability, num_heads)
        if self.kv_cache_dtype not in _KERNEL_CACHE_DTYPES[self.kernel]:
            raise ValueError(f"{name}: flashinfer's {self.kernel} MLA kernel (SM"
                             f"{device_capability.to_int()}, {num_heads} heads) reads "
                             f"{[str(d) for d in _KERNEL_CACHE_DTYPES[self.kernel]]} caches, "
                             f"got {self.kv_cache_dtype}")
        if block_size is not None:
            check_int_at_least(f"{name}: block_size", block_size, 1)
            self._check_block_size(block_size)
        self.block_size = block_size
        self.workspaces: WorkspaceSource = check_workspaces(name, workspaces)
        self._wrappers: dict[torch.device, Any] = {}
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._planned: _PlanKey | None = None
        # re-entrant: a run holds it across its plan check and launch, so another thread's
        # re-plan (a different scale) cannot swap the plan under a running call
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, config: EngineConfig,
                    device_capability: DeviceCapability | None = None, *,
                    workspaces: WorkspaceSource | None = None
                    ) -> FlashInferMLADecodeBackend:
        """An instance for ``config`` (its cache block size lets each step plan early)."""
        m = config.model
        fp8 = config.cache.kv_cache_dtype in ("fp8", "fp8_e4m3")   # issue 36
        return cls(num_heads=m.num_heads, scale=m.scale, kv_lora_rank=m.kv_lora_rank,
                   qk_rope_head_dim=m.qk_rope_head_dim,
                   kv_cache_dtype=torch.float8_e4m3fn if fp8 else m.dtype,
                   device_capability=device_capability, workspaces=workspaces,
                   block_size=config.cache.block_size)

    def workspace(self, device: torch.device, nbytes: int = WORKSPACE_BYTES) -> torch.Tensor:
        """The kernel's workspace on ``device`` (at least ``nbytes``, 128 MiB by default):
        zeroed for trtllm-gen (semaphores must start at 0), a float workspace for the
        wrapper."""
        name = WORKSPACE_TRTLLM_GEN if self.kernel == TRTLLM_GEN else WORKSPACE_WRAPPER
        return self.workspaces.get(name, nbytes, device, zeroed=self.kernel == TRTLLM_GEN)

    # -- what the kernel reads -----------------------------------------------------------

    def _check_block_size(self, block_size: int) -> None:
        if self.kernel == TRTLLM_GEN and block_size not in TRTLLM_GEN_BLOCK_SIZES:
            raise ValueError(f"{type(self).__name__}: trtllm-gen MLA decode reads cache blocks "
                             f"of {list(TRTLLM_GEN_BLOCK_SIZES)} tokens, got {block_size}")

    def query_dtypes(self) -> tuple[torch.dtype, ...]:
        """The query dtypes the kernel reads with this backend's cache dtype."""
        if self.kv_cache_dtype == torch.float8_e4m3fn or self.kernel == TRTLLM_GEN:
            return (torch.bfloat16,)
        return (self.kv_cache_dtype,)

    def fp8_query(self) -> bool:
        """trtllm-gen reads an FP8 cache with an FP8 query (quantised per call)."""
        return self._kernel_q_dtype() == torch.float8_e4m3fn

    def _kernel_q_dtype(self) -> torch.dtype:
        """The query dtype the kernel is handed (FP8 when trtllm-gen reads an FP8 cache)."""
        if self.kernel == TRTLLM_GEN and self.kv_cache_dtype == torch.float8_e4m3fn:
            return torch.float8_e4m3fn
        return self.query_dtypes()[0]

    # -- the plan (fa2 / fa3) ------------------------------------------------------------

    def _prepare_step(self, metadata: MLADecodeMetadata) -> None:
        """A new step: drop the previous plan, and plan now when block size and device are
        known (the first layer's call plans otherwise)."""
        with self._lock:
            self._planned = None
        device = metadata.block_table.device
        if (self.kernel != TRTLLM_GEN and self.block_size is not None and metadata.batch
                and (device.type == "cuda" or not self.requires_cuda)):
            self._ensure_plan(metadata, device, self.block_size, self.query_dtypes()[0],
                              self.scale)

    def csr_metadata(self, metadata: MLADecodeMetadata, page_size: int
                     ) -> dict[str, torch.Tensor]:
        """The step as host int32 CSR page metadata: ``qo_indptr [B+1]`` (query_len rows per
        request), ``kv_indptr [B+1]`` (pages), ``kv_indices`` (each request's live pages, in
        order), ``kv_len_arr [B]``."""
        seq = metadata.seq_lens_cpu.to(torch.int64)
        pages = (seq + page_size - 1) // page_size
        zero = torch.zeros(1, dtype=torch.int64)
        width = metadata.block_table_cpu.shape[1]
        live = torch.arange(width).unsqueeze(0) < pages.unsqueeze(1)
        return {
            "qo_indptr": (torch.arange(metadata.batch + 1) * metadata.query_len).to(torch.int32),
            "kv_indptr": torch.cat([zero, pages.cumsum(0)]).to(torch.int32),
            "kv_indices": metadata.block_table_cpu[live].to(torch.int32).contiguous(),
            "kv_len_arr": metadata.seq_lens_cpu.to(torch.int32).contiguous(),
        }

    def plan_kwargs(self, metadata: MLADecodeMetadata, page_size: int, q_dtype: torch.dtype,
                    sm_scale: float, kernels: FlashInferMLAKernels, *, pinned: bool = False
                    ) -> dict[str, Any]:
        """The keyword arguments of ``BatchMLAPagedAttentionWrapper.plan`` for the step;
        ``pinned``: the CSR metadata in pinned memory (the wrapper copies it to the GPU with
        ``non_blocking=True``, which waits for nothing only from pinned memory)."""
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        csr = self.csr_metadata(metadata, page_size)
        if pinned:
            csr = {name: t.pin_memory() for name, t in csr.items()}
        return {
            "metadata": kernels.plan_metadata.csr(**csr),
            "num_heads": self.num_heads, "head_dim_ckv": self.kv_lora_rank,
            "head_dim_kpe": self.qk_rope_head_dim, "page_size": page_size,
            # causal only matters inside a multi-token step (bottom-right aligned,
            # _fa_common.py:351); one query row sees the whole sequence either way
            "causal": metadata.query_len > 1, "sm_scale": sm_scale, "q_data_type": q_dtype,
            "kv_data_type": self.kv_cache_dtype, "query_layout": "packed",
            "kv_cache_layout": "packed", "lse_mode": "basee",
            "scale_mode": "kv-per-tensor" if fp8 else "default",
        }

    def _ensure_plan(self, metadata: MLADecodeMetadata, device: torch.device, page_size: int,
                     q_dtype: torch.dtype, sm_scale: float) -> Any:
        key: _PlanKey = (device, page_size, q_dtype, sm_scale)
        with self._lock:
            wrapper = self._wrappers.get(device)
            if self._planned == key and wrapper is not None:
                return wrapper
            kernels = self._kernels()
            if wrapper is None:
                wrapper = kernels.wrapper_cls(self.workspace(device), backend=self.kernel)
                self._wrappers[device] = wrapper
            wrapper.plan(**self.plan_kwargs(metadata, page_size, q_dtype, sm_scale, kernels,
                                            pinned=device.type == "cuda"))
            self._planned = key
            return wrapper

    def _lse_scratch(self, rows: int, device: torch.device) -> torch.Tensor:
        """Where the planned LSE goes when the caller wants none: one buffer per device, grown
        as needed, shared by every layer and call (nobody reads it, so calls that overlap on
        other threads or streams may write it at once)."""
        with self._lock:
            scratch = self._scratch.get(device)
            if scratch is None or scratch.numel() < rows * self.num_heads:
                scratch = torch.empty(rows * self.num_heads, dtype=torch.float32,
                                      device=device)
                self._scratch[device] = scratch
            return scratch[:rows * self.num_heads]

    def _kernels(self) -> FlashInferMLAKernels:
        kernels = _probe()
        if kernels is None:
            raise RuntimeError(self.unavailable_reason())
        return kernels

    # -- one call --------------------------------------------------------------------------

    def run_kwargs(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, k_scale: float) -> dict[str, Any]:
        """The keyword arguments of ``wrapper.run``: packed ``q [B*query_len, H, 576]``,
        ``out [B*query_len, H, 512]``, ``lse [B*query_len, H]`` (natural log)."""
        kwargs: dict[str, Any] = {"query": q, "kv_cache": kv_cache, "out": out, "lse": lse,
                                  "return_lse": True, "return_lse_base_on_e": True}
        if self.kv_cache_dtype == torch.float8_e4m3fn:
            kwargs.update(ckv_scale=k_scale, kpe_scale=k_scale)
        return kwargs

    def trtllm_kwargs(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor | None,
                      bmm1_scale: float | torch.Tensor, bmm2_scale: float | torch.Tensor
                      ) -> dict[str, Any]:
        """The keyword arguments of ``trtllm_batch_decode_with_kv_cache_mla``:
        ``q [B, query_len, H, 576]`` (bf16 or FP8), ``out [B, query_len, H, 512]`` bf16,
        ``lse [B, query_len, H]`` natural log when asked."""
        block_tables, seq_lens = metadata.on_device(q.device)
        return {
            "query": q, "kv_cache": kv_cache,
            "workspace_buffer": self.workspace(q.device, trtllm_gen_workspace_bytes(
                metadata.batch, metadata.query_len, self.num_heads, lse is not None)),
            "qk_nope_head_dim": _QK_NOPE_HEAD_DIM, "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim, "block_tables": block_tables,
            "seq_lens": seq_lens, "max_seq_len": metadata.max_seq_len, "out": out,
            "bmm1_scale": bmm1_scale, "bmm2_scale": bmm2_scale, "backend": TRTLLM_GEN,
            "is_var_seq": len(set(metadata.seq_lens_list)) > 1, "lse": lse,
            "return_lse": lse is not None, "return_lse_base": "basee",
        }

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        what = f"{type(self).__name__}.run_decode"
        if self.requires_cuda and q.device.type != "cuda":
            raise ValueError(f"{what}: expected CUDA tensors (the kernel runs on a GPU), got "
                             f"device {q.device}")
        check_query_dtype(what, q, self.query_dtypes(), self.kv_cache_dtype)
        page_size = int(kv_cache.shape[1])
        self._check_block_size(page_size)
        if self.kernel == TRTLLM_GEN:
            self._run_trtllm(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)
        else:
            self._run_wrapper(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)

    def _run_trtllm(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        bmm1: float | torch.Tensor = softmax_scale * k_scale
        bmm2: float | torch.Tensor = k_scale
        if self._kernel_q_dtype() == torch.float8_e4m3fn:
            # logits = softmax_scale * (q . k) with q = q8 * q_scale and k = k8 * k_scale; the
            # output is k_scale * (p @ c_kv8). The query's scale stays on the device: both
            # scales go as one-element float32 tensors (trtllm-gen's dynamic-scale form), so
            # no host sync.
            q, q_scale = quantize_query_fp8(q)
            bmm1 = q_scale * (softmax_scale * k_scale)
            bmm2 = torch.full_like(q_scale, k_scale)
        else:
            q = q.contiguous()
        self._kernels().trtllm_decode(**self.trtllm_kwargs(metadata, q, kv_cache, out, lse,
                                                           bmm1, bmm2))

    def _run_wrapper(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                     k_scale: float) -> None:
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        # a 16-bit cache has no scale argument: fold k_scale into the (planned) softmax
        # scale and scale the output after
        sm_scale = softmax_scale if fp8 else softmax_scale * k_scale
        rows = metadata.batch * metadata.query_len
        q_packed = q.contiguous().view(rows, self.num_heads, self.head_dim)
        lse_rows = (lse if lse is not None else self._lse_scratch(rows, q.device)).view(
            rows, self.num_heads)
        with self._lock:
            wrapper = self._ensure_plan(metadata, q.device, int(kv_cache.shape[1]), q.dtype,
                                        sm_scale)
            wrapper.run(**self.run_kwargs(q_packed, kv_cache,
                                          out.view(rows, self.num_heads, self.kv_lora_rank),
                                          lse_rows, k_scale))
        if not fp8 and k_scale != 1.0:
            out.mul_(k_scale)
