"""The CPU platform."""

from __future__ import annotations

import functools

import torch

from app._types import DeviceCapability
from app.platforms.base import Platform, SupportsMLADimensions


@functools.cache
def _cpu_has_native_bf16() -> bool:
    # AMX / AVX512-BF16 run bf16 GEMMs natively; plain AVX2 / AVX512 convert through float32.
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AMX" in capability or "BF16" in capability


class CpuPlatform(Platform):
    """A CPU: no compute capability; the torch SDPA backend is the only prefill kernel."""

    name = "cpu"
    device_type = "cpu"

    def get_device_capability(self) -> DeviceCapability | None:
        """CPUs have no compute capability: always None."""
        return None

    def mla_prefill_backend_priorities(self, selector_config: SupportsMLADimensions) -> list[str]:
        """Only ``TORCH_SDPA`` runs on a CPU."""
        return ["TORCH_SDPA"]

    def has_fast_bfloat16(self) -> bool:
        """True only on CPUs with native bf16 matmul (AMX or AVX512-BF16)."""
        return _cpu_has_native_bf16()

    def describe(self) -> dict[str, object]:
        """Adds torch's CPU vector capability to the base summary."""
        info = super().describe()
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        return info
