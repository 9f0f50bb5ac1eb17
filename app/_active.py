"""Which container is active: a ``ContextVar`` per thread and asyncio task.

Kept below everything (it imports nothing of the package) so that the plugin loader can make a
container active while a plugin runs without importing the composition root. The process
default container and ``get_container`` live in ``app.containers``; the seed API
(``app.seed_api``) reads ``ACTIVE_CONTAINER`` to key what it keeps.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["ACTIVE_CONTAINER", "activate", "active"]

#: The container made active for this thread / task (None: the process default).
ACTIVE_CONTAINER: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "app_active_container", default=None)


def active() -> Any:
    """The container made active by the innermost ``activate`` block, or None."""
    return ACTIVE_CONTAINER.get()


@contextlib.contextmanager
def activate(container: Any) -> Iterator[Any]:
    """Make ``container`` the active one inside the ``with`` block (this thread / task only);
    the caller has checked it is a container."""
    token = ACTIVE_CONTAINER.set(container)
    try:
        yield container
    finally:
        ACTIVE_CONTAINER.reset(token)
