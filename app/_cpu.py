"""Facts about this machine's CPU that the platform and the CPU kernels both read."""

from __future__ import annotations

import functools

import torch

__all__ = ["cpu_has_native_bf16"]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether bf16 matmuls run natively (AMX / AVX512-BF16); plain AVX2 / AVX512 convert
    through float32."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AMX" in capability or "BF16" in capability
