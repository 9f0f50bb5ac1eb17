"""A declarative, DI-wired registry of MLA prefill backends, KV-cache spec bindings and platform
hooks for LLM serving engines.

The public API is re-exported here; the subpackages (``app.backends``, ``app.kvcache``,
``app.platforms``, ``app.model`` (the DeepSeek-V2/V3 model and its checkpoint loader),
``app.mla`` (the engine loop), ``app.testing``) hold the rest. vLLM's documented API over the
active container (the backend enums, ``register_mla_prefill_backend``, the selectors,
``KVCacheSpecRegistry``) is ``app.seed_api``.
"""

import logging

# First, before anything imports torch: importing it sets the OpenMP wait policy, which
# torch's OpenMP runtime reads once, when loaded (see app._cpu).
import app._cpu  # noqa: F401
from app._types import DeviceCapability, MLADimensions
from app.config import AttentionConfig, CacheConfig, EngineConfig, ModelConfig
from app.containers import (
    Application,
    create_container,
    get_container,
    reset_default_container,
    set_default_container,
    use_container,
)
from app.platforms import CpuPlatform, CudaPlatform, Platform, detect_platform
from app.seed_api import (
    KVCacheSpecRegistry,
    MLADecodeBackendEnum,
    MLAPrefillBackendEnum,
    get_mla_decode_backend,
    get_mla_prefill_backend,
    register_kv_cache_spec,
    register_mla_decode_backend,
    register_mla_prefill_backend,
)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "Application",
    "AttentionConfig",
    "CacheConfig",
    "CpuPlatform",
    "CudaPlatform",
    "DeviceCapability",
    "EngineConfig",
    "KVCacheSpecRegistry",
    "MLADecodeBackendEnum",
    "MLADimensions",
    "MLAPrefillBackendEnum",
    "ModelConfig",
    "Platform",
    "__version__",
    "create_container",
    "detect_platform",
    "get_container",
    "get_mla_decode_backend",
    "get_mla_prefill_backend",
    "register_kv_cache_spec",
    "register_mla_decode_backend",
    "register_mla_prefill_backend",
    "reset_default_container",
    "set_default_container",
    "use_container",
]
