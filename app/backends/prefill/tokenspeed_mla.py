"""TOKENSPEED_MLA: ``tokenspeed_mla.tokenspeed_mla_prefill`` (SM100 / SM103 / SM107 only).

TokenSpeed's CuTe-DSL MLA prefill kernels, for DeepSeek R1 dimensions only (MLA dims
(128, 64, 128): q/k 192, v 128), bf16. Each kernel variant is compiled in-process at first
use (1.5-2 minutes each), so ``warmup_compile_prefill`` runs once per process and dtype before
the first launch: lazily, never at import. Only the ``return_lse=True`` variants are warmed up,
so every launch asks for the LSE (and drops it when the caller wants none) rather than compile
a third variant. The kernel writes ``out`` in place (contiguous bf16), and its LSE is already
natural log (``[T, H]``, transposed to the contract's ``[H, T]``); requests with no keys get
out 0 / LSE ``-inf``. ``cum_seq_lens`` is the **KV** prefix sum; ``cum_seq_lens_q`` the query's.

tokenspeed-mla is imported only when availability is asked or at first use (it swallows its
own import errors into ``tokenspeed_mla._IMPORT_ERROR``, which counts as unavailable);
``run_kwargs`` builds the call apart from the launch for the contract tests. Not run on a GPU
in this project's CI; see docs/gpu-results.md.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any, ClassVar

import torch

from app._types import ComputeCapabilities, MLADimensions
from app.backends.prefill.kernel_base import RaggedKernelBackend, RaggedLayout, unit_stride
from app.backends.vendors import (
    TOKENSPEED_CAPABILITIES,
    TOKENSPEED_INSTALL_HINT,
    TOKENSPEED_PACKAGE,
    probe_tokenspeed_mla,
)

__all__ = ["INSTALL_HINT", "SUPPORTED_CAPABILITIES", "TokenSpeedMLABackend",
           "TokenSpeedMLAPrefillBackend"]

logger = logging.getLogger(__name__)

#: What to install for TOKENSPEED_MLA (``app.backends.vendors``, where decode reads it too).
INSTALL_HINT = TOKENSPEED_INSTALL_HINT
#: The GPUs tokenspeed-mla's kernels support (``app.backends.vendors``).
SUPPORTED_CAPABILITIES = TOKENSPEED_CAPABILITIES
#: The tokenspeed_mla module, or None (``app.backends.vendors``; tests swap it here).
_probe = probe_tokenspeed_mla
_warmed: set[tuple[torch.dtype, int, int]] = set()
_warm_lock = threading.Lock()


def warmup(module: ModuleType, dtype: torch.dtype, qk_head_dim: int, v_head_dim: int) -> None:
    """Compile the causal and non-causal LSE variants once per process (thread-safe)."""
    key = (dtype, qk_head_dim, v_head_dim)
    with _warm_lock:
        if key in _warmed:
            return
        logger.info("TOKENSPEED_MLA: compiling prefill kernels for %s (%d, %d); this takes "
                    "a few minutes once per process", dtype, qk_head_dim, v_head_dim)
        module.warmup_compile_prefill(q_dtype=dtype, d_qk=qk_head_dim, d_v=v_head_dim)
        _warmed.add(key)


class TokenSpeedMLAPrefillBackend(RaggedKernelBackend):
    """TokenSpeed MLA prefill (CuTe DSL) for Blackwell, DeepSeek R1 dimensions, bf16."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)
    supported_mla_dimensions: ClassVar[tuple[MLADimensions, ...]] = (
        MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),)
    supports_out: ClassVar[bool] = True
    requires_device_capability: ClassVar[bool] = True

    #: SM100, SM103 and SM107 only (the kernels raise for any other architecture).
    compute_capabilities: ClassVar[ComputeCapabilities] = TOKENSPEED_CAPABILITIES
    #: tokenspeed-mla and its CuTe-DSL runtime (late-bound: tests swap the module's ``_probe``).
    probe = staticmethod(lambda: _probe())
    kernel_package: ClassVar[str | None] = TOKENSPEED_PACKAGE
    install_hint: ClassVar[str] = TOKENSPEED_INSTALL_HINT

    def _out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The kernel always writes bf16."""
        return torch.bfloat16

    def run_kwargs(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, causal: bool, out: torch.Tensor, kv_lens: torch.Tensor
                   ) -> dict[str, Any]:
        """The keyword arguments of ``tokenspeed_mla_prefill`` for one call."""
        return {
            "query": q, "key": k, "value": v, "seq_lens": kv_lens,
            "cum_seq_lens": layout.cu_kv, "max_seq_len": layout.max_kv,
            "batch_size": layout.batch, "softmax_scale": self.scale, "is_causal": causal,
            "return_lse": True, "cum_seq_lens_q": layout.cu_q, "max_seq_len_q": layout.max_q,
            "enable_pdl": False, "out": out,
        }

    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        module = _probe()
        if module is None:
            raise RuntimeError(self.unavailable_reason())
        warmup(module, q.dtype, self.qk_head_dim, self.v_head_dim)
        result = module.tokenspeed_mla_prefill(**self.run_kwargs(
            layout, unit_stride(q), unit_stride(k), v.contiguous(), causal, out,
            self._kv_lens(layout, q.device)))
        if lse is not None:
            self._copy_kernel_lse(result[1], layout, lse, tokens_first=True)


#: The class's old name (deprecated alias: its name now says its kind).
TokenSpeedMLABackend = TokenSpeedMLAPrefillBackend
