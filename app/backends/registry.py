"""The backend registry, written once for every kind: enums over the container's providers,
registration by path / decorator / new name, scoped overrides.

Every member of ``MLAPrefillBackendEnum`` (``MLADecodeBackendEnum``) names one provider of a
container (``container.mla_prefill_backends.<NAME>``); calling the provider gives the class.
There is no module-global mapping of overrides: registering overrides the member's provider
in the active container, ``clear_override`` resets it and ``is_overridden`` asks it, so a
fresh container (or one made active with ``use_container``) sees none of another container's
registrations.

- ``register_mla_prefill_backend(member, "pkg.mod.Class")`` overrides at once (the class is
  imported on first use); ``@register_mla_prefill_backend(member)`` records the decorated class
  itself; ``register_mla_prefill_backend("NAME", ...)`` adds a new member to the enum at run
  time. The member exists everywhere from then on, but only the containers it was registered
  in have a class for it; elsewhere it "must be registered before use".
- ``with override_mla_prefill_backend(member, cls_or_path): ...`` is the scoped form: on exit
  (even on an exception) exactly the override it pushed is removed.
- An abstract class is refused at registration (``TypeError``), whatever the kind.

The decode functions (``register_mla_decode_backend`` ...) are the same functions bound to the
decode kind. The selection cache needs no notice of any of this: it is keyed by the providers'
override stacks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import keyword
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from dependency_injector import containers

import app.backends._providers as _providers
from app._imports import object_path
from app.backends._enum import BackendEnum, BackendEnumMeta, active_backends, add_member, populate
from app.backends.kinds import DECODE, PREFILL, BackendKind

__all__ = [
    "BackendEnum",
    "ClassDecorator",
    "MLADecodeBackendEnum",
    "MLAPrefillBackendEnum",
    "enum_for",
    "override_backend",
    "override_mla_decode_backend",
    "override_mla_prefill_backend",
    "register_backend",
    "register_mla_decode_backend",
    "register_mla_prefill_backend",
    "resolve_backend_class",
]

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound=type)


class MLAPrefillBackendEnum(BackendEnum, metaclass=BackendEnumMeta):
    """The MLA prefill backends (members from ``app.backends.table.PREFILL_BACKENDS``, then
    ``CUSTOM``, then run-time additions); each value is the class path its provider imports
    by default. ``CUSTOM`` (value None, never an alias of another member) is the placeholder
    for a third-party backend and must be registered before use."""

    __kind__ = PREFILL


class MLADecodeBackendEnum(BackendEnum, metaclass=BackendEnumMeta):
    """The MLA decode backends (members from ``app.backends.table.DECODE_BACKENDS``, then
    ``CUSTOM``, then run-time additions), as ``MLAPrefillBackendEnum`` is for prefill."""

    __kind__ = DECODE


populate(MLAPrefillBackendEnum)
populate(MLADecodeBackendEnum)

_ENUMS: dict[str, type[BackendEnum]] = {PREFILL.name: MLAPrefillBackendEnum,
                                        DECODE.name: MLADecodeBackendEnum}
#: The members each enum was created with (run-time members come after these).
_BUILTIN_NAMES = {kind: frozenset(enum.__members__) for kind, enum in _ENUMS.items()}


def enum_for(kind: BackendKind) -> type[BackendEnum]:
    """The enum of ``kind``."""
    return _ENUMS[kind.name]


def resolve_backend_class(name: str, provider: Any, kind: BackendKind = PREFILL) -> type[Any]:
    """Call ``provider`` and check it gives a concrete backend class of ``kind`` (see
    ``app.backends._providers.resolve_class``)."""
    return _providers.resolve_class(kind, name, provider)


class ClassDecorator(Protocol):
    """What ``register_*_backend`` returns: a class decorator (or a no-op one)."""

    def __call__(self, cls: _C, /) -> _C: ...


def _identity(cls: _C, /) -> _C:
    return cls


@functools.cache
def _reserved_names() -> frozenset[str]:
    """Names a member must not take: attributes of the enum classes, their metaclass and of a
    container (a member's provider is an attribute of the backends container)."""
    classes = (inspect.getmro(MLAPrefillBackendEnum) + inspect.getmro(MLADecodeBackendEnum)
               + inspect.getmro(BackendEnumMeta))
    return (frozenset(name for cls in classes for name in vars(cls))
            | frozenset(dir(containers.DynamicContainer())))


def _check_new_name(kind: BackendKind, backends: Any, name: str) -> None:
    """``ValueError`` unless ``name`` can be registered by name in ``backends``: a valid,
    unreserved identifier that is not a built-in member and not already registered there (a
    run-time member added in another container may be registered here by name)."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
            or name.startswith("_"):
        raise ValueError(f"Invalid {kind.label} backend name: {name!r} (expected an "
                         f"identifier like 'MY_BACKEND', not starting with '_')")
    enum_cls = enum_for(kind)
    if name in enum_cls.__members__:
        provider = _providers.provider_of(backends, name)
        if name in _BUILTIN_NAMES[kind.name] or (provider is not None and provider.overridden):
            raise ValueError(
                f"{kind.label} backend {name} already exists in {kind.enum_name}. Use "
                f"{kind.register_name}({kind.enum_name}.{name}, 'your.module.YourClass') to "
                f"override it.")
        return
    if name in _reserved_names():
        raise ValueError(f"Invalid {kind.label} backend name: {name!r} is reserved")


def _push(kind: BackendKind, backends: Any, name: str, target: str | type[Any]) -> None:
    with _providers.REGISTRATION_LOCK:
        provider = _providers.provider_of(backends, name)
        if provider is None:
            provider = _providers.add_provider(backends, name)
        provider.override(_providers.overriding_provider(target))
    logger.info("Registered %s backend %s -> %s", kind.label, name,
                target if isinstance(target, str) else object_path(target))


def _as_member(kind: BackendKind, backend: object, where: str) -> BackendEnum:
    enum_cls = enum_for(kind)
    if isinstance(backend, enum_cls):
        return backend
    if isinstance(backend, str):
        return enum_cls[backend]
    raise TypeError(f"{where}: expected a {kind.enum_name} member or its name, "
                    f"got {backend!r} ({type(backend).__name__})")


def register_backend(kind: BackendKind, backends: Any, backend: BackendEnum | str,
                     class_path: str | type[Any] | None = None) -> ClassDecorator:
    """Register or override a backend of ``kind`` among ``backends`` (a container's
    providers of that kind); see ``register_mla_prefill_backend``."""
    where = kind.register_name
    enum_cls = enum_for(kind)
    register: Callable[[str | type[Any]], None]
    if isinstance(backend, str):
        _check_new_name(kind, backends, backend)

        def register(target: str | type[Any]) -> None:
            with kind.names.lock:
                _check_new_name(kind, backends, backend)
                member = add_member(enum_cls, backend)
                if member.name not in _BUILTIN_NAMES[kind.name]:
                    logger.info("Added %s backend %s", kind.label, member.name)
                _push(kind, backends, member.name, target)
    elif isinstance(backend, enum_cls):
        def register(target: str | type[Any]) -> None:
            _push(kind, backends, backend.name, target)
    else:
        raise TypeError(f"{where}: expected a {kind.enum_name} member or a new backend "
                        f"name, got {backend!r} ({type(backend).__name__})")
    if class_path is not None:
        register(_providers.check_target(kind, class_path, where))
        return _identity

    def register_class(cls: _C, /) -> _C:
        register(_providers.check_backend_class(kind, cls, where))
        return cls

    return register_class


@contextlib.contextmanager
def override_backend(kind: BackendKind, backends: Any, backend: BackendEnum | str,
                     cls_or_path: str | type[Any]) -> Iterator[BackendEnum]:
    """Override ``backend`` among ``backends`` for the ``with`` block; see
    ``override_mla_prefill_backend``."""
    where = f"override_{kind.label.lower().replace(' ', '_')}_backend"
    member = _as_member(kind, backend, where)
    overriding = _providers.overriding_provider(_providers.check_target(kind, cls_or_path, where))
    with _providers.REGISTRATION_LOCK:
        provider = _providers.provider_of(backends, member.name)
        created = provider is None
        if provider is None:
            provider = _providers.add_provider(backends, member.name)
        provider.override(overriding)
    try:
        yield member
    finally:
        with _providers.REGISTRATION_LOCK:
            if _providers.provider_of(backends, member.name) is provider:
                _providers.remove_overriding(provider, overriding)
                if created and not provider.overridden:
                    _providers.remove_provider(backends, member.name)


def register_mla_prefill_backend(
        backend: MLAPrefillBackendEnum | str,
        class_path: str | type[Any] | None = None) -> ClassDecorator:
    """Register or override an MLA prefill backend in the active container.

    - ``register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "my.mod.MyBackend")``:
      overrides at once (the class is imported on first use); returns a no-op decorator.
    - ``@register_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER)`` on a class: records
      that class (``TypeError`` if it is not a concrete ``MLAPrefillBackend`` subclass).
    - ``register_mla_prefill_backend("MY_BACKEND", path_or_class)`` or
      ``@register_mla_prefill_backend("MY_BACKEND")``: adds member ``MY_BACKEND`` to
      ``MLAPrefillBackendEnum`` and registers it in the active container. ``ValueError`` for a
      non-identifier or reserved name and for a duplicate: a built-in member's name, or a name
      already registered in the active container (a run-time member added in *another*
      container is registered here by name, so a plugin can run once per container).

    ``class_path`` may also be the class itself. Thread-safe.
    """
    return register_backend(PREFILL, active_backends(PREFILL), backend, class_path)


def override_mla_prefill_backend(
        backend: MLAPrefillBackendEnum | str,
        cls_or_path: str | type[Any]) -> contextlib.AbstractContextManager[BackendEnum]:
    """Override ``backend`` in the active container for the ``with`` block; yields the member.

    On exit, even on an exception, exactly the override this block pushed is removed, wherever
    it sits in the member's override stack: nested blocks restore the state each one entered
    with, and blocks that overlap in different threads of one container never leave an
    override behind. Other members and other containers are untouched.
    """
    return override_backend(PREFILL, active_backends(PREFILL), backend, cls_or_path)


def register_mla_decode_backend(
        backend: MLADecodeBackendEnum | str,
        class_path: str | type[Any] | None = None) -> ClassDecorator:
    """Register or override an MLA decode backend in the active container (as
    ``register_mla_prefill_backend``; the class must be a concrete ``MLADecodeBackend``)."""
    return register_backend(DECODE, active_backends(DECODE), backend, class_path)


def override_mla_decode_backend(
        backend: MLADecodeBackendEnum | str,
        cls_or_path: str | type[Any]) -> contextlib.AbstractContextManager[BackendEnum]:
    """Override an MLA decode backend in the active container for the ``with`` block (as
    ``override_mla_prefill_backend``)."""
    return override_backend(DECODE, active_backends(DECODE), backend, cls_or_path)
