"""MLA prefill backends: the base class, the registry and the selector."""

from app._types import DeviceCapability, MLADimensions
from app.backends.base import (
    ContextChunkMetadata,
    MLAPrefillBackend,
    MLAPrefillMetadata,
    MLAPrefillSelectorConfig,
)

__all__ = [
    "ContextChunkMetadata",
    "DeviceCapability",
    "MLADimensions",
    "MLAPrefillBackend",
    "MLAPrefillMetadata",
    "MLAPrefillSelectorConfig",
]
