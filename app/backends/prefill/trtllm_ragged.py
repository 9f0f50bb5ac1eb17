"""TRTLLM_RAGGED: ``flashinfer.prefill.trtllm_ragged_attention_deepseek`` (SM100 family only).

TensorRT-LLM's trtllm-gen ragged prefill kernels, shipped as prebuilt Blackwell cubins through
flashinfer (downloaded at first use, or taken from a version-matched ``flashinfer-cubin``).
They take q/k head dim 192 with v 128 (DeepSeek R1/V3: MLA dims (128, 64, 128)) or 256/256
(MLA dims (192, 64, 256)). The kernel needs a **zero-initialised** workspace (a counter region)
kept apart from any other workspace: one 256 MiB buffer per device. It writes ``out`` in place
and a base-2 ``[T, H]`` LSE, which is converted to the contract's natural-log ``[H, T]``. The
host length mirrors (``q_seq_lens_cpu``/``kv_seq_lens_cpu``) are always passed, so requests with
no keys get out 0 / LSE ``-inf`` without a device sync.

flashinfer-python is imported only when availability is asked or at first use; ``run_kwargs``
builds the call's arguments apart from the launch (contract tests bind them to the installed
signature). Not run on a GPU in this project's CI; see docs/gpu-results.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from app._types import ComputeCapabilities, MLADimensions
from app.backends.prefill.kernel_base import RaggedKernelBackend, RaggedLayout, unit_stride
from app.backends.vendors import (
    FLASHINFER_INSTALL_HINT,
    FLASHINFER_PACKAGE,
    SM100_FAMILY,
    probe_trtllm_ragged,
)

__all__ = ["TrtllmRaggedBackend", "TrtllmRaggedPrefillBackend"]

#: The zeroed workspace the kernel needs, one per device in each container.
WORKSPACE_BYTES = 256 * 1024 * 1024


#: ``flashinfer.prefill.trtllm_ragged_attention_deepseek``, or None (``app.backends.vendors``;
#: tests swap it here).
_probe = probe_trtllm_ragged


class TrtllmRaggedPrefillBackend(RaggedKernelBackend):
    """TensorRT-LLM ragged prefill through flashinfer: Blackwell (SM100/103/107) only."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_mla_dimensions: ClassVar[tuple[MLADimensions, ...]] = (
        MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256),
    )
    supports_out: ClassVar[bool] = True
    requires_device_capability: ClassVar[bool] = True

    #: The SM100 family (10.x) only: the cubins have no other architecture.
    compute_capabilities: ClassVar[ComputeCapabilities] = SM100_FAMILY
    #: ``flashinfer.prefill.trtllm_ragged_attention_deepseek`` (late-bound: tests swap
    #: the module's ``_probe``).
    probe = staticmethod(lambda: _probe())
    kernel_package: ClassVar[str | None] = FLASHINFER_PACKAGE
    install_hint: ClassVar[str] = FLASHINFER_INSTALL_HINT

    def run_kwargs(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, causal: bool, out: torch.Tensor, lse_nh: torch.Tensor,
                   workspace: torch.Tensor, kv_lens: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments of ``trtllm_ragged_attention_deepseek`` for one call.

        ``lse_nh``: a ``[T, H]`` float32 buffer for the kernel's base-2 LSE; ``kv_lens``:
        int32 per-request KV lengths on the GPU."""
        return {
            "query": q, "key": k, "value": v, "workspace_buffer": workspace,
            "seq_lens": kv_lens, "max_q_len": layout.max_q, "max_kv_len": layout.max_kv,
            "bmm1_scale": self.scale, "bmm2_scale": 1.0, "o_sf_scale": 1.0,
            "batch_size": layout.batch, "window_left": -1, "cum_seq_lens_q": layout.cu_q,
            "cum_seq_lens_kv": layout.cu_kv, "enable_pdl": False, "is_causal": causal,
            "return_lse": True, "out": out, "lse": lse_nh,
            "q_seq_lens_cpu": torch.tensor(layout.q_lens, dtype=torch.int32),
            "kv_seq_lens_cpu": torch.tensor(layout.kv_lens, dtype=torch.int32),
        }

    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        kernel = _probe()
        if kernel is None:
            raise RuntimeError(self.unavailable_reason())
        lse_nh = torch.empty(layout.total_q, self.num_heads, dtype=torch.float32,
                             device=q.device)
        kernel(**self.run_kwargs(layout, unit_stride(q), unit_stride(k), v.contiguous(),
                                 causal, out, lse_nh,
                                 self._workspace("trtllm-ragged", WORKSPACE_BYTES, q.device,
                                                 zeroed=True),
                                 self._kv_lens(layout, q.device)))
        if lse is not None:
            self._copy_kernel_lse(lse_nh, layout, lse, tokens_first=True, base2=True)


#: The class's old name (deprecated alias: its name now says its kind).
TrtllmRaggedBackend = TrtllmRaggedPrefillBackend
