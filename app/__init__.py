"""A declarative, DI-wired registry of MLA prefill backends, KV-cache spec bindings and platform
hooks for LLM serving engines.

The public API is re-exported here; the subpackages (``app.backends``, ``app.kvcache``,
``app.platforms``, ``app.model`` (the DeepSeek-V2/V3 model and its checkpoint loader),
``app.mla`` (the engine loop), ``app.testing``) hold the rest.
"""

import logging

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
    "MLADimensions",
    "ModelConfig",
    "Platform",
    "__version__",
    "create_container",
    "detect_platform",
    "get_container",
    "reset_default_container",
    "set_default_container",
    "use_container",
]
