"""MLA attention backends, prefill and decode: the base classes, one registry implementation
parameterized by kind, and the selectors.

The kernel backends (``app.backends.prefill.torch_sdpa``, ``flash_attn``, ``flashinfer``,
``trtllm_ragged``, ``tokenspeed_mla``, and the decode modules) are not imported here: the
container's providers import each one the first time it is asked for (the built-ins are listed
in ``app.backends.table``), and a backend whose kernel package is missing says so through
``validate_configuration``. ``app.backends.prefill.kernel_base`` is the public base kernel backends
build on.
"""

from app._types import DeviceCapability, MLADimensions
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.prefill.base import (
    ContextChunkMetadata,
    MLAPrefillBackend,
    MLAPrefillMetadata,
    MLAPrefillSelectorConfig,
)
from app.backends.registry import (
    MLADecodeBackendEnum,
    MLAPrefillBackendEnum,
    override_mla_decode_backend,
    override_mla_prefill_backend,
    register_mla_decode_backend,
    register_mla_prefill_backend,
)
from app.backends.selector import (
    check_decode_block_size,
    explain_mla_decode_selection,
    explain_mla_prefill_selection,
    get_mla_decode_backend,
    get_mla_prefill_backend,
)

__all__ = [
    "ContextChunkMetadata",
    "DeviceCapability",
    "MLADecodeBackend",
    "MLADecodeBackendEnum",
    "MLADecodeSelectorConfig",
    "MLADimensions",
    "MLAPrefillBackend",
    "MLAPrefillBackendEnum",
    "MLAPrefillMetadata",
    "MLAPrefillSelectorConfig",
    "check_decode_block_size",
    "explain_mla_decode_selection",
    "explain_mla_prefill_selection",
    "get_mla_decode_backend",
    "get_mla_prefill_backend",
    "override_mla_decode_backend",
    "override_mla_prefill_backend",
    "register_mla_decode_backend",
    "register_mla_prefill_backend",
]
