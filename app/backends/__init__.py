"""MLA prefill backends: the base class, the registry and the selector.

The kernel backends (``app.backends.torch_sdpa``, ``flash_attn``, ``flashinfer``,
``trtllm_ragged``, ``tokenspeed_mla``) are not imported here: the container's providers import
each one the first time it is asked for, and a backend whose kernel package is missing says so
through ``validate_configuration``.
"""

from app._types import DeviceCapability, MLADimensions
from app.backends.base import (
    ContextChunkMetadata,
    MLAPrefillBackend,
    MLAPrefillMetadata,
    MLAPrefillSelectorConfig,
)
from app.backends.decode_base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.registry import (
    MLAPrefillBackendEnum,
    override_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.selector import explain_mla_prefill_selection, get_mla_prefill_backend

__all__ = [
    "ContextChunkMetadata",
    "DeviceCapability",
    "MLADecodeBackend",
    "MLADecodeSelectorConfig",
    "MLADimensions",
    "MLAPrefillBackend",
    "MLAPrefillBackendEnum",
    "MLAPrefillMetadata",
    "MLAPrefillSelectorConfig",
    "explain_mla_prefill_selection",
    "get_mla_prefill_backend",
    "override_mla_prefill_backend",
    "register_mla_prefill_backend",
]
