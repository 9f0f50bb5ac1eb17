"""Facts about the GPU kernel packages, written once for both kinds of backend.

flashinfer-python, tokenspeed-mla and flash-attn each serve prefill and (but flash-attn) decode.
What the two kinds must agree on lives here: each package's import name (``kernel_package``),
its install hint, the GPUs its kernels are built for, and its probes (the import of its entry
points: ``functools.cache``-d, None when anything fails to import, never at module import).
``prefill/`` and ``decode/`` both import this module and never each other.

Each backend module keeps its probe under its own module name (``_probe``, ``_probe_fa4`` ...)
and reads it late (``probe = staticmethod(lambda: _probe())``), so a test may swap one
backend's probe without touching the other kind's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs

from app._types import ComputeCapabilities, DeviceCapability

__all__ = [
    "FLASHINFER_CAPABILITIES",
    "FLASHINFER_INSTALL_HINT",
    "FLASHINFER_PACKAGE",
    "FLASH_ATTN_4_MAJORS",
    "FLASH_ATTN_CAPABILITIES",
    "FLASH_ATTN_INSTALL_HINT",
    "FLASH_ATTN_PACKAGE",
    "SM100_FAMILY",
    "TOKENSPEED_CAPABILITIES",
    "TOKENSPEED_INSTALL_HINT",
    "TOKENSPEED_PACKAGE",
    "TRTLLM_GEN_MLA_CAPABILITIES",
    "FlashInferMLAKernels",
    "probe_flash_attn_2",
    "probe_flash_attn_4",
    "probe_flashinfer",
    "probe_flashinfer_mla",
    "probe_tokenspeed_mla",
    "probe_trtllm_ragged",
]

# -- flashinfer-python ------------------------------------------------------------------------

#: flashinfer's import name.
FLASHINFER_PACKAGE = "flashinfer"
#: Why FLASHINFER, TRTLLM_RAGGED and FLASHINFER_MLA cannot run without it.
FLASHINFER_INSTALL_HINT = "flashinfer-python is not installed (pip install 'app[flashinfer]')"
#: SM80 (Ampere) and newer: the ragged prefill wrapper and the paged MLA decode wrapper (fa2).
FLASHINFER_CAPABILITIES = ComputeCapabilities(minimum=DeviceCapability(8, 0))
#: The SM100 family (10.x): trtllm-gen's ragged prefill cubins have no other architecture.
SM100_FAMILY = ComputeCapabilities(minimum=DeviceCapability(10, 0), below=DeviceCapability(11, 0))
#: The Blackwell GPUs trtllm-gen ships MLA decode cubins for (fmhaKernels.cuh:67
#: isSMCompatible).
TRTLLM_GEN_MLA_CAPABILITIES = ComputeCapabilities(only=(
    DeviceCapability(10, 0), DeviceCapability(10, 3), DeviceCapability(10, 7)))


@functools.cache
def probe_flashinfer() -> ModuleType | None:
    """The flashinfer module with its ragged prefill wrapper, or None when it does not import."""
    try:
        import flashinfer
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper  # noqa: F401
    except Exception:  # any import-time failure means "not available"
        return None
    return flashinfer


@functools.cache
def probe_trtllm_ragged() -> Callable[..., Any] | None:
    """``flashinfer.prefill.trtllm_ragged_attention_deepseek``, or None."""
    try:
        from flashinfer.prefill import trtllm_ragged_attention_deepseek
    except Exception:  # any import-time failure means "not available"
        return None
    return trtllm_ragged_attention_deepseek  # type: ignore[no-any-return]


@attrs.frozen
class FlashInferMLAKernels:
    """The flashinfer entry points FLASHINFER_MLA calls (tests pass stand-ins)."""

    #: ``flashinfer.mla.BatchMLAPagedAttentionWrapper``.
    wrapper_cls: Any
    #: ``flashinfer.mla.MLAPlanMetadata`` (its ``csr`` constructor).
    plan_metadata: Any
    #: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``.
    trtllm_decode: Callable[..., Any]


@functools.cache
def probe_flashinfer_mla() -> FlashInferMLAKernels | None:
    """flashinfer's MLA decode entry points, or None when they do not import."""
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
    except Exception:  # any import-time failure means "not available"
        return None
    return FlashInferMLAKernels(wrapper_cls=BatchMLAPagedAttentionWrapper,
                                plan_metadata=MLAPlanMetadata,
                                trtllm_decode=trtllm_batch_decode_with_kv_cache_mla)


# -- tokenspeed-mla ---------------------------------------------------------------------------

#: tokenspeed-mla's import name.
TOKENSPEED_PACKAGE = "tokenspeed_mla"
#: What to install for TOKENSPEED_MLA (prefill and decode).
TOKENSPEED_INSTALL_HINT = "tokenspeed-mla is not installed (pip install 'app[tokenspeed]')"
#: The GPUs tokenspeed-mla's kernels (prefill and decode) support: SM100, SM103 and SM107
#: (``mla_helpers.get_mla_decode_arch``; the kernels raise for any other architecture).
TOKENSPEED_CAPABILITIES = ComputeCapabilities(only=(
    DeviceCapability(10, 0), DeviceCapability(10, 3), DeviceCapability(10, 7)))


@functools.cache
def probe_tokenspeed_mla() -> ModuleType | None:
    """The tokenspeed_mla module, or None when it (or its CUDA/CuTe stack) does not import
    (it swallows its own import errors into ``tokenspeed_mla._IMPORT_ERROR``, which counts as
    not importing)."""
    try:
        import tokenspeed_mla
    except Exception:  # any import-time failure means "not available"
        return None
    module: ModuleType = tokenspeed_mla
    return None if hasattr(module, "_IMPORT_ERROR") else module


# -- flash-attn -------------------------------------------------------------------------------

#: flash-attn's import name (FA2 ``flash_attn``; FA4 ``flash_attn.cute``).
FLASH_ATTN_PACKAGE = "flash_attn"
#: Why FLASH_ATTN cannot run without one of them.
FLASH_ATTN_INSTALL_HINT = (
    "neither flash-attn-4 (pip install --pre flash-attn-4, plus triton) nor flash-attn 2 "
    "(pip install flash-attn, builds against CUDA) is installed")
#: SM80 (Ampere) and newer (FA2; FA4 on the majors below).
FLASH_ATTN_CAPABILITIES = ComputeCapabilities(minimum=DeviceCapability(8, 0))
#: GPU major versions FA4's forward kernels cover for MLA shapes.
FLASH_ATTN_4_MAJORS = (9, 10, 11)


@functools.cache
def probe_flash_attn_4() -> Callable[..., Any] | None:
    """FA4's ``flash_attn.cute.flash_attn_varlen_func``, or None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # any import-time failure means "not available"
        return None
    return flash_attn_varlen_func  # type: ignore[no-any-return]


@functools.cache
def probe_flash_attn_2() -> Callable[..., Any] | None:
    """FA2's ``flash_attn.flash_attn_varlen_func``, or None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # any import-time failure means "not available"
        return None
    return flash_attn_varlen_func  # type: ignore[no-any-return]
