"""FLASH_ATTN: FlashAttention's varlen kernels, FA4 (``flash_attn.cute``) or FA2.

- **FA4** (``pip install --pre flash-attn-4``: ``flash_attn.cute.flash_attn_varlen_func``,
  CuTe DSL, SM90 / SM100 / SM110) takes q/k 192 with v 128 directly and returns the LSE as
  ``[H, T]`` natural log (rows with no key: ``-inf``). It needs ``triton`` importable too.
- **FA2** (``flash_attn.flash_attn_varlen_func``, SM80+) needs v's head dim equal to q/k's, so
  v is zero-padded to the q/k head dim and the output sliced back; ``return_attn_probs=True``
  makes it return the LSE, natural log, ``[H, T]`` (older releases: padded ``[B, H, L]``,
  gathered here); rows with no key get LSE ``+inf`` there, which is replaced by ``-inf``.

FA4 is used where it supports the GPU, FA2 elsewhere; the backend is unavailable when neither
imports. Both use a bottom-right causal mask. Neither public varlen function takes ``out=``, so
``out`` is filled by a copy (``supports_out`` is False). Neither package is imported at module
import. flash-attn 2 has no wheel on PyPI (it builds from source against CUDA), so it could not
be installed in this project's CPU CI: the argument construction (``fa4_kwargs``, ``fa2_args``)
is checked against the signatures read from the upstream sources instead. Not run on a GPU in
this project's CI; see docs/gpu-results.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from app._types import ComputeCapabilities, DeviceCapability
from app.backends.prefill.base import MLAPrefillSelectorConfig
from app.backends.prefill.kernel_base import RaggedKernelBackend, RaggedLayout, unit_stride
from app.backends.vendors import (
    FLASH_ATTN_4_MAJORS,
    FLASH_ATTN_CAPABILITIES,
    FLASH_ATTN_INSTALL_HINT,
    FLASH_ATTN_PACKAGE,
    probe_flash_attn_2,
    probe_flash_attn_4,
)

__all__ = ["FlashAttnBackend", "FlashAttnPrefillBackend", "flash_attn_variant_for"]

#: GPU major versions FA4's forward kernels cover for MLA shapes.
_FA4_MAJORS = FLASH_ATTN_4_MAJORS
#: FA4's and FA2's varlen functions, or None (``app.backends.vendors``; tests swap them here).
_probe_fa4 = probe_flash_attn_4
_probe_fa2 = probe_flash_attn_2


def flash_attn_variant_for(capability: DeviceCapability) -> str | None:
    """``"fa4"``, ``"fa2"`` or None: which installed FlashAttention runs on this GPU."""
    if capability.major in _FA4_MAJORS and _probe_fa4() is not None:
        return "fa4"
    if capability.major >= 8 and _probe_fa2() is not None:
        return "fa2"
    return None


class FlashAttnPrefillBackend(RaggedKernelBackend):
    """FlashAttention varlen prefill (FA4 on SM90/SM100, FA2 with padded v on SM80+)."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supports_out: ClassVar[bool] = False
    requires_device_capability: ClassVar[bool] = True

    #: SM80 (Ampere) and newer.
    compute_capabilities: ClassVar[ComputeCapabilities] = FLASH_ATTN_CAPABILITIES
    #: flash-attn-4 (``flash_attn.cute``) or flash-attn 2 (late-bound: tests swap the
    #: module's probes).
    probe = staticmethod(lambda: _probe_fa4() or _probe_fa2())
    kernel_package: ClassVar[str | None] = FLASH_ATTN_PACKAGE
    install_hint: ClassVar[str] = FLASH_ATTN_INSTALL_HINT

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLAPrefillSelectorConfig) -> list[str]:
        """The base checks, plus: the installed FlashAttention must run on this GPU (FA4
        alone does not run on SM80) and the head dims must fit (q/k <= 256, multiple of 8,
        v <= q/k)."""
        reasons = super().validate_configuration(device_capability, selector_config)
        dims = selector_config.mla_dimensions
        if (device_capability is not None and cls.supports_compute_capability(device_capability)
                and cls.is_available() and flash_attn_variant_for(device_capability) is None):
            reasons.append(f"flash-attn-4 does not run on SM{device_capability.to_int()}; "
                           f"install flash-attn 2")
        if not (dims.qk_head_dim <= 256 and dims.qk_head_dim % 8 == 0
                and dims.v_head_dim <= dims.qk_head_dim and dims.v_head_dim % 8 == 0):
            reasons.append(f"Model does not have supported MLA dimensions (got {dims}; "
                           f"needs q/k head dim <= 256 and v <= q/k, both multiples of 8)")
        return reasons

    def fa4_kwargs(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, causal: bool, want_lse: bool) -> dict[str, Any]:
        """The keyword arguments of FA4's ``flash_attn_varlen_func`` for one call."""
        return {"q": q, "k": k, "v": v, "cu_seqlens_q": layout.cu_q,
                "cu_seqlens_k": layout.cu_kv, "max_seqlen_q": layout.max_q,
                "max_seqlen_k": layout.max_kv, "softmax_scale": self.scale, "causal": causal,
                "return_lse": want_lse}

    def fa2_args(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                 v_padded: torch.Tensor, causal: bool, want_lse: bool
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments of FA2's ``flash_attn_varlen_func``."""
        args = (q, k, v_padded, layout.cu_q, layout.cu_kv, layout.max_q, layout.max_kv)
        return args, {"dropout_p": 0.0, "softmax_scale": self.scale, "causal": causal,
                      "return_attn_probs": want_lse}

    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        capability = self._require_capability()
        variant = flash_attn_variant_for(capability)
        if variant == "fa4":
            fa4 = _probe_fa4()
            if fa4 is None:  # pragma: no cover - checked by flash_attn_variant_for
                raise RuntimeError(self.unavailable_reason())
            result = fa4(**self.fa4_kwargs(layout, q, k, unit_stride(v), causal,
                                           lse is not None))
            o, lg = result if isinstance(result, tuple) else (result, None)
        elif variant == "fa2":
            fa2 = _probe_fa2()
            if fa2 is None:  # pragma: no cover - checked by flash_attn_variant_for
                raise RuntimeError(self.unavailable_reason())
            dqk, dv = self.qk_head_dim, self.v_head_dim
            vp = unit_stride(v) if dv == dqk else torch.nn.functional.pad(v, (0, dqk - dv))
            args, kwargs = self.fa2_args(layout, unit_stride(q), unit_stride(k), vp, causal,
                                         lse is not None)
            result = fa2(*args, **kwargs)
            o, lg = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
            o = o[..., :dv]
        else:
            raise RuntimeError(f"{self.get_name()}: no installed FlashAttention runs on "
                               f"SM{capability.to_int()}")
        out.copy_(o)
        if lse is not None:
            if lg is None:
                raise RuntimeError(f"{self.get_name()}: the kernel returned no LSE")
            self._copy_kernel_lse(lg, layout, lse, tokens_first=False)


#: The class's old name (deprecated alias: its name now says its kind).
FlashAttnBackend = FlashAttnPrefillBackend
