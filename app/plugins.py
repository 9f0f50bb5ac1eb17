"""Out-of-tree plugins, discovered through entry points.

Two groups, as in vLLM:

- ``app.platform_plugins``: each entry point is a function taking no arguments that returns the
  dotted path of a ``Platform`` subclass when its hardware is present, or None.
- ``app.general_plugins``: each entry point is a function taking no arguments that registers
  backends or KV-cache specs (``register_mla_prefill_backend``, ``KVCacheSpecRegistry.register``).

The environment variable ``APP_PLUGINS`` (comma-separated entry-point names) restricts which
plugins load; unset means all, empty means none. Plugins load once per process; a plugin that
raises is logged with its name and skipped.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from app._imports import import_object
from app.platforms.base import Platform

__all__ = [
    "GENERAL_PLUGINS_GROUP",
    "PLATFORM_PLUGINS_GROUP",
    "PLUGINS_ENV",
    "load_general_plugins",
    "load_platform_plugin",
    "reset_plugin_state",
]

logger = logging.getLogger(__name__)

PLATFORM_PLUGINS_GROUP = "app.platform_plugins"
GENERAL_PLUGINS_GROUP = "app.general_plugins"
PLUGINS_ENV = "APP_PLUGINS"

_lock = threading.Lock()
_general_loaded = False
_general_results: dict[str, bool] = {}


def _allowed_names() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load_entry_points(group: str) -> dict[str, Callable[[], Any]]:
    """The allowed entry points of ``group``, loaded; failures are logged and skipped."""
    allowed = _allowed_names()
    loaded: dict[str, Callable[[], Any]] = {}
    for ep in importlib.metadata.entry_points(group=group):
        if allowed is not None and ep.name not in allowed:
            logger.debug("plugin %s (%s) not in %s; skipped", ep.name, group, PLUGINS_ENV)
            continue
        try:
            func = ep.load()
        except Exception:
            logger.exception("failed to load plugin %s (%s); skipped", ep.name, group)
            continue
        if not callable(func):
            logger.error("plugin %s (%s) is not callable: %r; skipped", ep.name, group, func)
            continue
        loaded[ep.name] = func
    return loaded


def load_platform_plugin() -> Platform | None:
    """The platform of the first platform plugin whose hardware is present, or None.

    A plugin returns a dotted path of a ``Platform`` subclass (or None when absent). More than
    one active platform plugin is a ``ValueError``: the deployment must choose with APP_PLUGINS.
    """
    active: dict[str, str] = {}
    for name, func in _load_entry_points(PLATFORM_PLUGINS_GROUP).items():
        try:
            path = func()
        except Exception:
            logger.exception("platform plugin %s raised; skipped", name)
            continue
        if path is None:
            continue
        if not isinstance(path, str):
            logger.error("platform plugin %s returned %r, expected a class path or None; "
                         "skipped", name, path)
            continue
        active[name] = path
    if not active:
        return None
    if len(active) > 1:
        raise ValueError(f"several platform plugins are active: {sorted(active)}; choose one "
                         f"with {PLUGINS_ENV}=<name>")
    name, path = next(iter(active.items()))
    cls = import_object(path)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"platform plugin {name} returned {path!r}, which is not a Platform "
                        f"subclass")
    logger.info("platform plugin %s selected %s", name, path)
    platform: Platform = cls()
    return platform


def load_general_plugins() -> dict[str, bool]:
    """Run every allowed general plugin once per process; returns ``{name: succeeded}``.

    Idempotent: later calls return the first call's results without running anything.
    """
    global _general_loaded
    with _lock:
        if _general_loaded:
            return dict(_general_results)
        for name, func in _load_entry_points(GENERAL_PLUGINS_GROUP).items():
            try:
                func()
            except Exception:
                logger.exception("general plugin %s raised; skipped", name)
                _general_results[name] = False
            else:
                logger.info("loaded general plugin %s", name)
                _general_results[name] = True
        _general_loaded = True
        return dict(_general_results)


def reset_plugin_state() -> None:
    """Forget which general plugins ran (for tests that install plugins)."""
    global _general_loaded
    with _lock:
        _general_loaded = False
        _general_results.clear()
