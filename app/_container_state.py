"""The state of the containers that outlives a call: which container is active, and a count of
every change to any container's providers.

**Which container is active**: a ``ContextVar`` per thread and asyncio task, set by
``activate`` (``app.containers.use_container``; the plugin loader makes a container active while
a plugin runs), else the process default. ``active_container()`` answers; the composition root
(``app.containers``, which ``import app`` always loads) installs the factory that builds the
default on first use (``install_default_factory``) and wraps all of this as ``get_container`` /
``set_default_container`` / ``reset_default_container``. Held here, below everything, so that
the seed API's modules (``app.backends.seed_api``, ``app.kvcache.seed_api``) can ask for the
active container from inside their own packages without an import running up to the root.

**What changed**: every provider the containers are built from is one of the ``Counted*``
types below. Their ``override``, ``reset_override`` and ``reset_last_overriding`` (and a
singleton's ``reset``) bump ``CHANGES`` *after* they act, however they are reached: called
directly, as a context manager, through ``container.override_providers(...)``,
``container.reset_override()`` or ``container.reset_singletons()``. The registry bumps it too
when it adds or removes a backend provider, and so does replacing the process-default container.

A reader takes ``CHANGES.count`` *before* it resolves anything and keeps the result with that
count; the result is current while the count is the same. (A change racing with the reader only
makes the kept result unusable, never wrong.) ``app.backends.selection.SelectionCache`` keys its
entries by the count; the seed API keeps its last answers per active container with
``keep_if_unchanged`` and drops them on every change (``on_change``), so its hot path compares
nothing but the active container.

**Taking registrations back**: inside a ``rollback_on_error()`` block (this thread / task), a
registration records how to undo itself (``record_undo``); when the block raises, the undos run,
newest first, so a failed step (a general plugin that registers and then raises, a deployment
refused half-way) leaves nothing behind. The backend registry and the KV-cache spec bindings
record their registrations; code that builds a registry's own state (the built-ins, a platform
hook) runs under ``undo_suspended()``.

This module imports nothing from the package: it sits below everything that builds providers.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dependency_injector import containers, providers

__all__ = [
    "ACTIVE_CONTAINER",
    "CHANGES",
    "ChangeCounter",
    "CountedCallable",
    "CountedContainer",
    "CountedFactory",
    "CountedObject",
    "CountedSingleton",
    "activate",
    "active",
    "active_container",
    "check_container",
    "install_default_factory",
    "record_undo",
    "reset_default",
    "rollback_on_error",
    "set_default",
    "undo_suspended",
]

logger = logging.getLogger(__name__)

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


def check_container(container: object, where: str) -> Any:
    """``container`` if it is an application container (a dependency-injector container with
    the backend providers); ``TypeError`` naming ``where`` (the caller), what is expected and
    what was given otherwise."""
    if not (containers.is_container(container)
            and isinstance(getattr(container, "mla_prefill_backends", None),
                           providers.Container)):
        raise TypeError(f"{where}: expected an app.containers.Application instance, "
                        f"got {container!r} ({type(container).__name__})")
    return container


class ChangeCounter:
    """A counter that only goes up (thread-safe); read ``count``, call ``bump()``.

    ``on_change(forget)`` registers a function called (under the counter's lock) on every
    bump, so a reader can drop what it kept instead of comparing counts on every call; a
    reader stores what it resolved with ``keep_if_unchanged``, which refuses a result computed
    before a change that happened meanwhile."""

    def __init__(self) -> None:
        #: The number of changes so far.
        self.count = 0
        self._lock = threading.Lock()
        self._forgetters: list[Callable[[], None]] = []

    def bump(self) -> None:
        """Count one change (call it after the change is complete)."""
        with self._lock:
            self.count += 1
            for forget in self._forgetters:
                forget()

    def on_change(self, forget: Callable[[], None]) -> None:
        """Call ``forget()`` on every change from now on."""
        with self._lock:
            self._forgetters.append(forget)

    def keep_if_unchanged(self, count: int, keep: Callable[[], None]) -> bool:
        """Call ``keep()`` only if nothing changed since ``count`` was read (atomically with
        respect to ``bump``); whether it was called."""
        with self._lock:
            if self.count != count:
                return False
            keep()
            return True

    def __repr__(self) -> str:
        return f"ChangeCounter(count={self.count})"


#: The one counter of this process.
CHANGES = ChangeCounter()


# -- the process-default container ------------------------------------------------------------

_default_lock = threading.Lock()
_default: Any = None
_default_factory: Callable[[], Any] | None = None


def install_default_factory(factory: Callable[[], Any]) -> None:
    """Build the process default with ``factory()`` when it is first asked for (the composition
    root installs ``create_container`` when it is imported)."""
    global _default_factory
    _default_factory = factory


def active_container() -> Any:
    """The active container: the innermost ``activate`` block's, else the process default
    (built on first use)."""
    current = ACTIVE_CONTAINER.get()
    if current is not None:
        return current
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                if _default_factory is None:
                    raise RuntimeError("no default container can be built: the composition "
                                       "root (app.containers) was not imported")
                _default = _default_factory()
    return _default


def set_default(container: Any) -> None:
    """Make ``container`` (checked by the caller) the process default; counted."""
    global _default
    with _default_lock:
        _default = container
    CHANGES.bump()


def reset_default() -> None:
    """Drop the process default (the next ``active_container()`` builds a fresh one); counted."""
    global _default
    with _default_lock:
        _default = None
    CHANGES.bump()


T = TypeVar("T")


class _Counted:
    """Bumps ``CHANGES`` after every change to the provider's override stack."""

    def override(self, provider: Any) -> Any:
        """As the provider's own ``override``; counted."""
        try:
            return super().override(provider)  # type: ignore[misc]
        finally:
            CHANGES.bump()

    def reset_override(self) -> None:
        """As the provider's own ``reset_override``; counted."""
        try:
            super().reset_override()  # type: ignore[misc]
        finally:
            CHANGES.bump()

    def reset_last_overriding(self) -> None:
        """As the provider's own ``reset_last_overriding``; counted."""
        try:
            super().reset_last_overriding()  # type: ignore[misc]
        finally:
            CHANGES.bump()


class CountedObject(_Counted, providers.Object[T]):
    """``providers.Object`` whose overrides are counted."""


class CountedCallable(_Counted, providers.Callable[T]):
    """``providers.Callable`` whose overrides are counted."""


class CountedFactory(_Counted, providers.Factory[T]):
    """``providers.Factory`` whose overrides are counted."""


class CountedContainer(_Counted, providers.Container[T]):
    """``providers.Container`` whose overrides are counted."""


class CountedSingleton(_Counted, providers.Singleton[T]):
    """``providers.Singleton`` whose overrides and resets are counted."""

    def reset(self) -> Any:
        """As ``Singleton.reset``; counted (the next call makes a new instance)."""
        try:
            return super().reset()
        finally:
            CHANGES.bump()


# -- taking registrations back ----------------------------------------------------------------

#: The undos recorded in the innermost ``rollback_on_error`` block (None: outside any).
_UNDO: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "app_undo_journal", default=None)


def record_undo(undo: Callable[[], None]) -> None:
    """Called by a registration once it has changed something: inside a ``rollback_on_error``
    block, remember ``undo`` (which takes exactly that change back); elsewhere, nothing."""
    journal = _UNDO.get()
    if journal is not None:
        journal.append(undo)


@contextlib.contextmanager
def rollback_on_error() -> Iterator[None]:
    """Run the block; if it raises, undo every registration recorded inside it (newest first)
    and re-raise. An undo that fails is logged and the others still run. A block nested in
    another hands what it recorded to the outer one when it succeeds, so an outer failure
    takes it back too."""
    journal: list[Callable[[], None]] = []
    outer = _UNDO.get()
    token = _UNDO.set(journal)
    try:
        yield
    except BaseException:
        _UNDO.reset(token)
        for undo in reversed(journal):
            try:
                undo()
            except Exception:  # one failed undo must not keep the others from running
                logger.exception("could not undo a registration (%r)", undo)
        raise
    else:
        _UNDO.reset(token)
        if outer is not None:
            outer.extend(journal)


@contextlib.contextmanager
def undo_suspended() -> Iterator[None]:
    """Inside the block nothing is recorded: for state built on first use (a registry's
    built-ins, a platform hook) that must outlive a failed step that happened to trigger it."""
    token = _UNDO.set(None)
    try:
        yield
    finally:
        _UNDO.reset(token)
