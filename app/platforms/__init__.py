"""Platform hooks: what a CPU, a Hopper GPU or a Blackwell GPU supports and prefers."""

from app._types import DeviceCapability
from app.platforms.base import Platform, SupportsMLADimensions, wants_sparse
from app.platforms.cpu import CpuPlatform
from app.platforms.cpu_features import CpuFeatures, detect_cpu_features, read_cpu_features
from app.platforms.cuda import TRTLLM_PREFERRED_DIMENSIONS, CudaPlatform
from app.platforms.detect import (
    PLATFORM_ENV,
    default_device,
    detect_platform,
    parse_device_capability,
    platform_for_device,
    platform_from_environment,
)

__all__ = [
    "PLATFORM_ENV",
    "TRTLLM_PREFERRED_DIMENSIONS",
    "CpuFeatures",
    "CpuPlatform",
    "CudaPlatform",
    "DeviceCapability",
    "Platform",
    "SupportsMLADimensions",
    "default_device",
    "detect_cpu_features",
    "detect_platform",
    "parse_device_capability",
    "platform_for_device",
    "platform_from_environment",
    "read_cpu_features",
    "wants_sparse",
]
