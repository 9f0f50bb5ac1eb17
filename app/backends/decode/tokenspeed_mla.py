"""TOKENSPEED_MLA (decode): ``tokenspeed_mla.tokenspeed_mla_decode`` on SM100 / SM103 / SM107.

TokenSpeed's CuTe-DSL MLA decode kernels (``tokenspeed_mla/mla_decode.py``), DeepSeek latent
dims only (kv_lora_rank 512, rope 64: ``mla_decode_fp16.py:3981``), at most 128 heads
(``:3996``), cache blocks that divide the kernel's 128-key tile and are not 1 (``:3990``,
``mla_decode_fp8.py:4778``): 2, 4, 8, 16, 32, 64 or 128 tokens. Query and cache share one dtype
(fp16 / bf16), or the cache is FP8 e4m3 and the bf16 query is quantised per call (the kernel
asserts ``kv_cache.dtype == query.dtype``, ``mla_decode.py:884``), then the output is bf16.

What the re-created vLLM backend got wrong, and this one does not:

- **Scales are per call.** ``softmax_scale`` (times the call's ``k_scale`` and, for FP8, the
  query's own quantisation scale) and ``output_scale`` (the call's ``k_scale``) are computed
  from the arguments of every ``run_decode``; nothing is cached from an earlier call, so a
  profiling run's placeholder scales cannot leak into serving.
- **No reshape of a non-uniform batch.** The base class refuses a non-uniform ``query_len``
  (and a block table that does not cover ``seq_lens``) before any kernel runs; the query is
  handed over as ``[B, query_len, H, 576]``, batch for batch with the block table.
- **The workspace grows, and the old one goes.** It is sized by the package's documented
  formula (``mla_decode.py:778``: ``B * 128 * ceil(H * q_len / 128) * split_kv * (512 + 1) *
  4`` bytes, 0 when ``split_kv == 1``) with ``split_kv`` at its upper bound for the batch
  (``min(64, SMs // (B * ceil(H * q_len / 128)))``, what the package's split heuristics can
  pick), checked at every step and replaced by a larger buffer when the batch or query_len
  needs more; it is int8, as the kernel asserts (``mla_decode.py:1019``), per device, held by
  the backend instance (or shared through the ``workspaces`` passed in).

With ``causal_mask=True`` row ``i`` of a multi-token step sees keys below
``K - (query_len - 1) + i`` (``mla_decode_fp16.py:2920``): the contract's causal rule.
``is_var_seq`` is False exactly when every request of the step has the same length (the kernel
then runs its persistent schedule); ``max_seq_len`` is the step's longest sequence. The kernel's
LSE is base 2 (``mla_decode_fp16.py:3539-3540``: ``log2(row_sum) + scale_log2 * row_max``) and
is converted to natural log; it is always requested, so one compiled variant (per dtype, page
size, heads, query_len, ``is_var_seq``) serves calls with and without LSE. Variants compile
in-process (CuTe DSL) at first use. Not run on a GPU in this project's CI; see
docs/gpu-results.md.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any, ClassVar

import torch

from app._types import ComputeCapabilities, DeviceCapability, MLADimensions
from app.backends.decode._gpu import (
    base2_to_natural,
    check_query_dtype,
    check_workspaces,
    fp8_query_reasons,
    insert_reasons,
    quantize_query_fp8,
)
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.vendors import (
    TOKENSPEED_CAPABILITIES,
    TOKENSPEED_INSTALL_HINT,
    TOKENSPEED_PACKAGE,
    probe_tokenspeed_mla,
)
from app.backends.workspaces import WorkspaceSource

__all__ = [
    "MAX_HEADS",
    "WORKSPACE_NAME",
    "TokenSpeedMLADecodeBackend",
    "tokenspeed_workspace_bytes",
]

#: The most query heads one kernel tile holds (mla_decode_fp16.py:3996).
MAX_HEADS = 128
#: The kernel's query-row tile (M) and the largest split-KV count its heuristics pick.
_M_TILE, _MAX_SPLIT_KV = 128, 64
#: The name of this backend's workspace in a shared ``WorkspaceSource``.
WORKSPACE_NAME = "tokenspeed_mla.decode"


#: The tokenspeed_mla module, or None (``app.backends.vendors``; tests swap it here).
_probe = probe_tokenspeed_mla


def tokenspeed_workspace_bytes(batch: int, query_len: int, num_heads: int, kv_lora_rank: int,
                               num_sms: int) -> int:
    """An upper bound on the workspace ``tokenspeed_mla_decode`` needs for this batch.

    The documented formula with every factor at its largest: the query rows padded to whole
    128-row tiles (packing and folding both fit in them), and ``split_kv`` at
    ``min(64, SMs // (B * tiles))`` (the package's heuristics divide the SMs by the batch and
    by the effective query length, which is at least the tile count). 0 when no split fits."""
    tiles = -(-num_heads * query_len // _M_TILE)
    split_kv = min(_MAX_SPLIT_KV, max(1, num_sms // (batch * tiles)))
    if split_kv == 1:
        return 0
    return batch * _M_TILE * tiles * split_kv * (kv_lora_rank + 1) * 4


class TokenSpeedMLADecodeBackend(MLADecodeBackend):
    """TokenSpeed MLA decode (CuTe DSL) for Blackwell: bf16 / fp16 / FP8 caches, query_len
    1..16, per-call scales, a workspace that grows with the batch."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float8_e4m3fn)
    #: e4m3 with one scale per layer (the query quantised per call); not FlashMLA's row.
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8", "fp8_e4m3")
    kv_cache_dtype_notes: ClassVar[dict[str, str]] = {
        "fp8_ds_mla": "tokenspeed-mla 2.0.4 reads one cache dtype per call (fp16, bf16 or "
                      "e4m3 with one scale), not the 656-byte FlashMLA row"}
    #: Divisors of the kernel's 128-key tile, except 1 (mla_decode_fp16.py:3990).
    supported_block_sizes: ClassVar[tuple[int, ...]] = (2, 4, 8, 16, 32, 64, 128)
    supported_mla_dimensions: ClassVar[tuple[MLADimensions, ...]] = (
        MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64),)
    requires_device_capability: ClassVar[bool] = True
    #: Not run on a GPU: whether its kernel leaves rows that do not see a non-finite key of
    #: the step alone is unknown, so it is not claimed (the engine then trusts no row of a
    #: request whose step turned non-finite; see ``MLADecodeBackend``).
    isolates_nonfinite_keys: ClassVar[bool] = False
    #: Whether the kernel needs CUDA tensors (contract tests lift it to run stand-ins on CPU).
    requires_cuda: ClassVar[bool] = True

    #: SM100, SM103 and SM107, as prefill (mla_helpers.get_mla_decode_arch).
    compute_capabilities: ClassVar[ComputeCapabilities] = TOKENSPEED_CAPABILITIES
    #: tokenspeed-mla and its CuTe-DSL runtime (late-bound: tests swap the module's ``_probe``).
    probe = staticmethod(lambda: _probe())
    kernel_package: ClassVar[str | None] = TOKENSPEED_PACKAGE
    install_hint: ClassVar[str] = TOKENSPEED_INSTALL_HINT

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLADecodeSelectorConfig) -> list[str]:
        """The base class's reasons plus the kernel's head limit (with the dimensions)."""
        heads = selector_config.num_heads
        extra = [] if heads <= MAX_HEADS else [
            f"{heads} query heads not supported (at most {MAX_HEADS})"]
        return insert_reasons(cls, device_capability, selector_config, dimensions=extra,
                              dtype=fp8_query_reasons(selector_config))

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int,
                 kv_cache_dtype: torch.dtype | str, *,
                 device_capability: DeviceCapability | None = None,
                 workspaces: WorkspaceSource | None = None) -> None:
        """``workspaces``: shared kernel workspaces (the container's; default: this
        instance's own ``KernelWorkspaces``)."""
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype,
                         device_capability=device_capability, workspaces=workspaces)
        name = type(self).__name__
        if device_capability is not None and not self.supports_compute_capability(
                device_capability):
            raise ValueError(f"{name}: compute capability {device_capability} not supported "
                             f"(SM100, SM103 or SM107)")
        if not self.supports_mla_dimensions(MLADimensions(kv_lora_rank=kv_lora_rank,
                                                          qk_rope_head_dim=qk_rope_head_dim)):
            raise ValueError(f"{name}: (kv_lora_rank, qk_rope_head_dim) must be one of "
                             f"{list(self.supported_head_dims)}, got "
                             f"({kv_lora_rank}, {qk_rope_head_dim})")
        if num_heads > MAX_HEADS:
            raise ValueError(f"{name}: at most {MAX_HEADS} query heads, got {num_heads}")
        self.workspaces: WorkspaceSource = check_workspaces(name, workspaces)
        self._num_sms: dict[torch.device, int] = {}
        self._lock = threading.Lock()

    def fp8_query(self) -> bool:
        """An FP8 cache is read with the query quantised to e4m3 per call."""
        return self.kv_cache_dtype == torch.float8_e4m3fn

    def query_dtypes(self) -> tuple[torch.dtype, ...]:
        """The query dtypes the kernel reads with this backend's cache dtype."""
        if self.kv_cache_dtype == torch.float8_e4m3fn:
            return (torch.bfloat16,)
        return (self.kv_cache_dtype,)

    def _module(self) -> ModuleType:
        module = _probe()
        if module is None:
            raise RuntimeError(self.unavailable_reason())
        return module

    def _sm_count(self, device: torch.device) -> int:
        with self._lock:
            count = self._num_sms.get(device)
            if count is None:
                count = int(self._module().get_num_sm(device))
                self._num_sms[device] = count
            return count

    def workspace_bytes(self, metadata: MLADecodeMetadata, device: torch.device) -> int:
        """What the step's batch and query_len need (``tokenspeed_workspace_bytes``)."""
        if metadata.batch == 0:
            return 0
        return tokenspeed_workspace_bytes(metadata.batch, metadata.query_len, self.num_heads,
                                          self.kv_lora_rank, self._sm_count(device))

    def workspace(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The workspace on ``device``, at least ``nbytes``, as the int8 view the kernel
        asserts (``mla_decode.py:1019``)."""
        return self.workspaces.get(WORKSPACE_NAME, nbytes, device).view(torch.int8)

    def _prepare_step(self, metadata: MLADecodeMetadata) -> None:
        """Grow the workspace for the step now when its device is known (else at the first
        layer's call; either way once per step, before any launch)."""
        device = metadata.block_table.device
        if metadata.batch and (device.type == "cuda" or not self.requires_cuda):
            self.workspace(device, self.workspace_bytes(metadata, device))

    def decode_kwargs(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                      out: torch.Tensor, workspace: torch.Tensor, softmax_scale: float,
                      output_scale: float) -> dict[str, Any]:
        """The keyword arguments of ``tokenspeed_mla_decode`` for one call: ``q [B,
        query_len, H, 576]`` contiguous, ``out [B, query_len, H, 512]``, LSE always asked."""
        block_tables, seq_lens = metadata.on_device(q.device)
        return {
            "query": q, "kv_cache": kv_cache, "workspace_buffer": workspace,
            "kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
            "block_tables": block_tables, "seq_lens": seq_lens,
            "max_seq_len": metadata.max_seq_len, "softmax_scale": softmax_scale,
            "output_scale": output_scale, "out": out,
            "is_var_seq": len(set(metadata.seq_lens_list)) > 1, "causal_mask": True,
            "enable_pdl": False, "return_lse": True,
        }

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        what = f"{type(self).__name__}.run_decode"
        if self.requires_cuda and q.device.type != "cuda":
            raise ValueError(f"{what}: expected CUDA tensors (the kernel runs on a GPU), got "
                             f"device {q.device}")
        check_query_dtype(what, q, self.query_dtypes(), self.kv_cache_dtype)
        q_scale = 1.0
        if self.kv_cache_dtype == torch.float8_e4m3fn:
            q, q_scale_t = quantize_query_fp8(q)
            q_scale = float(q_scale_t)  # the kernel takes host floats: one sync per call
        else:
            q = q.contiguous()
        workspace = self.workspace(q.device, self.workspace_bytes(metadata, q.device))
        # logits = softmax_scale * (q . k) with q = q8 * q_scale and k = k8 * k_scale; the
        # output is k_scale * (p @ c_kv8). Both come from this call's arguments only.
        result = self._module().tokenspeed_mla_decode(**self.decode_kwargs(
            metadata, q, kv_cache, out, workspace, softmax_scale * k_scale * q_scale, k_scale))
        if lse is not None:
            base2_to_natural(result[1], lse)
