"""The CUDA platform: Ampere, Hopper and Blackwell GPUs."""

from __future__ import annotations

from typing import Any

import torch

from app._types import DeviceCapability, MLADimensions
from app._validation import check_int_at_least
from app.catalog import DECODE_BACKENDS, PREFILL_BACKENDS
from app.platforms.base import Platform, SupportsMLADimensions, wants_sparse

#: The DeepSeek-V3.2-style dimensions TRTLLM ragged is tuned for: preferred first on SM100.
TRTLLM_PREFERRED_DIMENSIONS = MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64,
                                            v_head_dim=256)


# The priority lists, checked against the catalog once, when this module is imported.
_PREFILL_SM100 = PREFILL_BACKENDS.check("FLASH_ATTN", "TRTLLM_RAGGED", "FLASHINFER",
                                        "TOKENSPEED_MLA", "TORCH_SDPA")
_PREFILL_SM100_TRTLLM_FIRST = PREFILL_BACKENDS.check("TRTLLM_RAGGED", "FLASH_ATTN", "FLASHINFER",
                                                     "TOKENSPEED_MLA", "TORCH_SDPA")
_PREFILL_SM90 = PREFILL_BACKENDS.check("FLASH_ATTN", "FLASHINFER", "TORCH_SDPA")
_PREFILL_OTHER = PREFILL_BACKENDS.check("FLASH_ATTN", "TORCH_SDPA")
_DECODE_SM100 = DECODE_BACKENDS.check("FLASHINFER_MLA", "TOKENSPEED_MLA", "TORCH_SDPA")
_DECODE_SM100_MTP = DECODE_BACKENDS.check("TOKENSPEED_MLA", "FLASHINFER_MLA", "TORCH_SDPA")
_DECODE_OTHER = DECODE_BACKENDS.check("FLASHINFER_MLA", "TORCH_SDPA")
# A sparse model's (DeepSeek Sparse Attention): no GPU sparse kernel is wired yet.
_SPARSE_PREFILL = PREFILL_BACKENDS.check("TORCH_SPARSE")
_SPARSE_DECODE = DECODE_BACKENDS.check("TORCH_SPARSE")


class CudaPlatform(Platform):
    """An NVIDIA GPU.

    ``CudaPlatform()`` reads the capability of ``device_index`` with torch (``ValueError`` when
    CUDA is not available). ``CudaPlatform(device_capability=DeviceCapability(10, 0))`` pretends to
    be that GPU without touching CUDA, which is how tests check Blackwell or Hopper behaviour on a
    machine without one.
    """

    name = "cuda"
    device_type = "cuda"

    def __init__(self, device_capability: DeviceCapability | None = None,
                 device_index: int = 0) -> None:
        if device_capability is not None and not isinstance(device_capability, DeviceCapability):
            raise TypeError("CudaPlatform: device_capability must be a DeviceCapability or None, "
                            f"got {device_capability!r}")
        check_int_at_least("CudaPlatform: device_index", device_index, 0)
        self._emulated = device_capability is not None
        if device_capability is None:
            device_capability = _detect_capability(device_index)
        self._capability = device_capability
        self.device_index = device_index

    @property
    def is_emulated(self) -> bool:
        """True when the capability was given rather than read from a real GPU."""
        return self._emulated

    def get_device_capability(self) -> DeviceCapability:
        """The GPU's compute capability (``DeviceCapability(9, 0)`` on an H100)."""
        return self._capability

    def mla_prefill_backend_priorities(self, selector_config: SupportsMLADimensions) -> list[str]:
        """Fastest first: SM100 family, SM90, then everything older or newer (a sparse model:
        ``TORCH_SPARSE``)."""
        if wants_sparse(selector_config):
            return list(_SPARSE_PREFILL)
        cap = self._capability
        if cap.is_family(10):
            if selector_config.mla_dimensions == TRTLLM_PREFERRED_DIMENSIONS:
                return list(_PREFILL_SM100_TRTLLM_FIRST)
            return list(_PREFILL_SM100)
        if cap.is_family(9):
            return list(_PREFILL_SM90)
        return list(_PREFILL_OTHER)

    def mla_decode_backend_priorities(self, selector_config: Any) -> list[str]:
        """SM100 family: FLASHINFER_MLA, TOKENSPEED_MLA, TORCH_SDPA, except that TOKENSPEED_MLA
        goes first when ``selector_config.query_len > 1`` (its gains grow with multi-token
        prediction); SM90 and others: FLASHINFER_MLA, TORCH_SDPA; a sparse model:
        TORCH_SPARSE."""
        if wants_sparse(selector_config):
            return list(_SPARSE_DECODE)
        if self._capability.is_family(10):
            if getattr(selector_config, "query_len", 1) > 1:
                return list(_DECODE_SM100_MTP)
            return list(_DECODE_SM100)
        return list(_DECODE_OTHER)

    @property
    def device(self) -> torch.device:
        """``cuda:<device_index>``."""
        return torch.device("cuda", self.device_index)

    def describe(self) -> dict[str, object]:
        """Adds the device name (or that the capability is emulated) to the base summary."""
        info = super().describe()
        info["emulated"] = self._emulated
        if not self._emulated:
            info["device_name"] = torch.cuda.get_device_name(self.device_index)
            info["cuda_version"] = torch.version.cuda
        return info


def _detect_capability(device_index: int) -> DeviceCapability:
    if not torch.cuda.is_available():
        raise ValueError("CudaPlatform: CUDA is not available on this machine; pass "
                         "device_capability=DeviceCapability(major, minor) to emulate a GPU")
    count = torch.cuda.device_count()
    if device_index >= count:
        raise ValueError(f"CudaPlatform: device_index {device_index} out of range; "
                         f"this machine has {count} CUDA device(s)")
    major, minor = torch.cuda.get_device_capability(device_index)
    return DeviceCapability(major, minor)
