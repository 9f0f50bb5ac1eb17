"""Out-of-tree plugins, discovered through entry points.

Two groups, as in vLLM:

- ``app.platform_plugins``: each entry point is a function taking no arguments that returns the
  dotted path of a ``Platform`` subclass when its hardware is present, or None.
- ``app.general_plugins``: each entry point is a function taking no arguments that registers
  backends or KV-cache specs (``register_mla_prefill_backend``, ``KVCacheSpecRegistry.register``).

The environment variable ``APP_PLUGINS`` (comma-separated entry-point names) restricts which
plugins load; unset means all, empty means none. Entry points are imported once per process; a
plugin that raises is logged with its name and skipped, and whatever a general plugin registered
before it raised (backends, overrides, KV-cache specs) is taken back. A platform plugin whose
``Platform`` class does not import or cannot be constructed is an error naming the plugin.

Registrations live in containers, so a general plugin runs once on every container that
``create_container`` builds (the process default included): a deployment or a test's fresh
container sees the same plugins as the default one.

This module sits with the platforms (the platform detection asks it for a plugin's platform);
``app.plugins``, its first home, re-exports it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from app._container_state import activate, rollback_on_error
from app._imports import import_object
from app.platforms.base import Platform

__all__ = [
    "GENERAL_PLUGINS_GROUP",
    "PLATFORM_PLUGINS_GROUP",
    "PLUGINS_ENV",
    "apply_general_plugins",
    "load_general_plugins",
    "load_platform_plugin",
    "reset_plugin_state",
]

#: Named for the module's first home (``app.plugins``, which still imports): a deployment's
#: logging configuration for plugin messages keeps working.
logger = logging.getLogger("app.plugins")

PLATFORM_PLUGINS_GROUP = "app.platform_plugins"
GENERAL_PLUGINS_GROUP = "app.general_plugins"
PLUGINS_ENV = "APP_PLUGINS"

_lock = threading.RLock()
_loaded: dict[str, dict[str, Callable[[], Any]]] = {}


def _allowed_names() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load_entry_points(group: str) -> dict[str, Callable[[], Any]]:
    """The allowed entry points of ``group``, imported once per process.

    An entry point that fails to import, or is not callable, is logged with its name and
    skipped.
    """
    with _lock:
        if group in _loaded:
            return _loaded[group]
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
        _loaded[group] = loaded
        return loaded


def load_platform_plugin() -> Platform | None:
    """The platform of the platform plugin whose hardware is present, or None.

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
    where = f"platform plugin {name} returned {path!r}"
    try:
        cls = import_object(path)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"{where}, which does not import: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"{where}, which is not a Platform subclass")
    logger.info("platform plugin %s selected %s", name, path)
    try:
        platform: Platform = cls()
    except Exception as exc:  # a third party's constructor: any failure is a bad platform
        raise ValueError(f"{where}: constructing {cls.__name__}() raised "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    return platform


def load_general_plugins() -> list[str]:
    """Import the allowed general plugins (once per process); returns their names."""
    return list(_load_entry_points(GENERAL_PLUGINS_GROUP))


def apply_general_plugins(container: Any) -> dict[str, bool]:
    """Run every general plugin once on ``container`` (active while it runs).

    Returns ``{name: succeeded}`` for this container. Idempotent: a plugin already applied to
    the container is not run again. A plugin that raises is logged with its name and skipped,
    and what it registered before it raised is taken back (``rollback_on_error``).
    """
    applied: dict[str, bool] = container.applied_general_plugins()
    with _lock:
        for name, func in _load_entry_points(GENERAL_PLUGINS_GROUP).items():
            if name in applied:
                continue
            try:
                with activate(container), rollback_on_error():
                    func()
            except Exception:
                logger.exception("general plugin %s raised; what it registered was taken "
                                 "back; skipped", name)
                applied[name] = False
            else:
                logger.info("applied general plugin %s", name)
                applied[name] = True
        return dict(applied)


def reset_plugin_state() -> None:
    """Forget the imported entry points (for tests that install plugins or change
    ``APP_PLUGINS``); containers already built keep what was applied to them."""
    with _lock:
        _loaded.clear()
