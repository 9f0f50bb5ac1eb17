"""Compatibility: plugin discovery moved to ``app.platforms.plugins`` (the platform detection
asks it for a plugin's platform); this import path, documented for deployments, keeps working
and names the same functions."""

from app.platforms.plugins import (
    GENERAL_PLUGINS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    PLUGINS_ENV,
    apply_general_plugins,
    load_general_plugins,
    load_platform_plugin,
    reset_plugin_state,
)

__all__ = [
    "GENERAL_PLUGINS_GROUP",
    "PLATFORM_PLUGINS_GROUP",
    "PLUGINS_ENV",
    "apply_general_plugins",
    "load_general_plugins",
    "load_platform_plugin",
    "reset_plugin_state",
]
