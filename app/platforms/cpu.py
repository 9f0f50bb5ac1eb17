"""The CPU platform."""

from __future__ import annotations

import torch

from app._cpu import detect_cpu_features
from app._types import DeviceCapability
from app.catalog import DECODE_BACKENDS, PREFILL_BACKENDS
from app.platforms.base import Platform, SupportsMLADimensions, wants_sparse

# The priority lists, checked against the catalog once, when this module is imported.
_PREFILL = PREFILL_BACKENDS.check("TORCH_SDPA")
_DECODE = DECODE_BACKENDS.check("CPU_MLA", "TORCH_SDPA")
# A sparse model's (DeepSeek Sparse Attention): the backends that run it.
# The native CPU_MLA_SPARSE kernels first, TORCH_SPARSE where they cannot run.
_SPARSE_PREFILL = PREFILL_BACKENDS.check("CPU_MLA_SPARSE", "TORCH_SPARSE")
_SPARSE_DECODE = DECODE_BACKENDS.check("CPU_MLA_SPARSE", "TORCH_SPARSE")


class CpuPlatform(Platform):
    """A CPU: no compute capability; TORCH_SDPA prefill, CPU_MLA then TORCH_SDPA decode
    (CPU_MLA_SPARSE then TORCH_SPARSE for both for a sparse model)."""

    name = "cpu"
    device_type = "cpu"

    def get_device_capability(self) -> DeviceCapability | None:
        """CPUs have no compute capability: always None."""
        return None

    def mla_prefill_backend_priorities(self, selector_config: SupportsMLADimensions) -> list[str]:
        """``TORCH_SDPA`` (``CPU_MLA_SPARSE`` then ``TORCH_SPARSE`` for a sparse model)."""
        return list(_SPARSE_PREFILL if wants_sparse(selector_config) else _PREFILL)

    def mla_decode_backend_priorities(self, selector_config: object) -> list[str]:
        """The native ``CPU_MLA`` kernel, then ``TORCH_SDPA`` (``CPU_MLA_SPARSE`` then
        ``TORCH_SPARSE`` for a sparse model)."""
        return list(_SPARSE_DECODE if wants_sparse(selector_config) else _DECODE)

    def has_fast_bfloat16(self) -> bool:
        """True only on CPUs with native bf16 products (AVX512-BF16 or AMX-BF16), read from the
        CPU itself (:func:`app.platforms.detect_cpu_features`): AMX / AVX512-BF16 run bf16
        GEMMs natively; plain AVX2 / AVX512 convert through float32."""
        return detect_cpu_features().fast_bfloat16

    def describe(self) -> dict[str, object]:
        """Adds the CPU model, its vector features (read from the CPU) and torch's CPU
        capability string to the base summary."""
        info = super().describe()
        features = detect_cpu_features()
        info["cpu_model"] = features.model_name
        info["cpu_features"] = features.as_dict()
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        return info
