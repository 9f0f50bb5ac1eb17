"""Detecting the platform of this machine."""

from __future__ import annotations

import logging

import torch

from app.platforms.base import Platform
from app.platforms.cpu import CpuPlatform
from app.platforms.cuda import CudaPlatform

logger = logging.getLogger(__name__)


def detect_platform() -> Platform:
    """The platform of this machine: ``CudaPlatform`` where a CUDA GPU is visible, else CPU.

    Platform plugins (entry-point group ``app.platform_plugins``) are consulted first.
    """
    plugin_platform = _platform_from_plugins()
    if plugin_platform is not None:
        return plugin_platform
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        platform: Platform = CudaPlatform()
    else:
        platform = CpuPlatform()
    logger.debug("detected platform %r", platform)
    return platform


def _platform_from_plugins() -> Platform | None:
    # Imported here: the plugin loader imports entry points, which may import this package.
    from app.plugins import load_platform_plugin

    return load_platform_plugin()
