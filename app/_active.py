"""Which container is active: a ``ContextVar`` per thread and asyncio task.

Kept below everything (it imports nothing of the package) so that the plugin loader can make a
container active while a plugin runs without importing the composition root. The process
default container and ``get_container`` live in ``app.containers``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["activate", "active"]

_active_container: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "app_active_container", default=None)


def active() -> Any:
    """The container made active by the innermost ``activate`` block, or None."""
    return _active_container.get()


@contextlib.contextmanager
def activate(container: Any) -> Iterator[Any]:
    """Make ``container`` the active one inside the ``with`` block (this thread / task only);
    the caller has checked it is a container."""
    token = _active_container.set(container)
    try:
        yield container
    finally:
        _active_container.reset(token)
