"""vLLM's documented backend API (the seeds) over the *active* container: the backend enums
``MLAPrefillBackendEnum`` / ``MLADecodeBackendEnum`` (``get_path``, ``get_class``,
``is_overridden``, ``clear_override``, and ``is_registered``), ``register_mla_prefill_backend``
/ ``override_mla_prefill_backend`` (decode alike), and the selectors ``get_mla_prefill_backend``
/ ``get_mla_decode_backend`` with their ``explain_*`` forms (each takes ``container=``; default:
the active container). Re-exported by ``app.backends`` and ``app.seed_api``.

Each call asks which container is active (``app._container_state.active_container()``, the
leaf that ``app.containers.use_container`` and ``get_container`` stand on) and hands its
providers to the registry and the selection, which never look a container up themselves. This
module and ``app.kvcache.seed_api`` are the only ones below the composition root that ask. The
last answers of the selectors are kept for the active container and dropped on every provider
change (``app._container_state.CHANGES``): any override, reset or registration, made through
this API or directly on a provider, takes effect on the next call.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from enum import Enum, EnumMeta
from typing import Any, Protocol, TypeVar

from dependency_injector.containers import Container

from app._container_state import ACTIVE_CONTAINER, CHANGES, active_container, check_container
from app.backends.decode.base import MLADecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.backends.registry import (
    DECODE,
    PREFILL,
    REGISTRATION_LOCK,
    BackendKind,
    check_backend_class,
    check_new_name,
    check_target,
    class_path,
    override_backend,
    provider_of,
    register_backend,
    reserve_names,
    resolve_class,
    unregistered_message,
)
from app.backends.selection import SelectionExplanation, explain_selection, select_backend
from app.catalog import CUSTOM
from app.config import EngineConfig

__all__ = [
    "BackendEnum",
    "ClassDecorator",
    "MLADecodeBackendEnum",
    "MLAPrefillBackendEnum",
    "explain_mla_decode_selection",
    "explain_mla_prefill_selection",
    "get_mla_decode_backend",
    "get_mla_prefill_backend",
    "override_mla_decode_backend",
    "override_mla_prefill_backend",
    "register_mla_decode_backend",
    "register_mla_prefill_backend",
]

logger = logging.getLogger(__name__)

_E = TypeVar("_E", bound=Enum)
_C = TypeVar("_C", bound=type)

#: The active container as ``use_container`` set it (None: the process default). Bound once:
#: the kept answers below are keyed by it.
_active_key = ACTIVE_CONTAINER.get


# -- the enums ---------------------------------------------------------------------------------

class BackendEnumMeta(EnumMeta):
    """``Enum["NAME"]`` raises ``ValueError`` listing the valid names (vLLM's wording)."""

    def __getitem__(cls: type[_E], name: str) -> _E:  # type: ignore[misc]
        try:
            return cls._member_map_[name]  # type: ignore[return-value]
        except (KeyError, TypeError):
            kind: BackendKind = cls.__kind__  # type: ignore[attr-defined]
            raise ValueError(kind.catalog.unknown_message(name)) from None


class BackendEnum(Enum, metaclass=BackendEnumMeta):
    """Base of ``MLAPrefillBackendEnum`` and ``MLADecodeBackendEnum``: its members are the
    kind's catalog (built-ins, ``CUSTOM``, then names registered at run time); a built-in's
    value is the class path its provider imports by default (None for ``CUSTOM`` and run-time
    members, whose class lives only in the containers they were registered in)."""

    @classmethod
    def _kind(cls) -> BackendKind:
        kind: BackendKind = cls.__kind__  # type: ignore[attr-defined]
        return kind

    def _provider(self) -> Any:
        return provider_of(self._kind().backends_of(active_container()), self.name)

    def get_path(self) -> str:
        """The dotted path of the class this member resolves to in the active container
        (overrides honoured). ``ValueError`` when the member is not registered there."""
        kind, provider = self._kind(), self._provider()
        if provider is None:
            raise ValueError(unregistered_message(kind, self.name, in_container=True))
        return class_path(kind, self.name, provider)

    def get_class(self) -> type[Any]:
        """The backend class in the active container, imported on first use.

        Raises ``ValueError`` when the member is not registered there, ``ImportError`` when its
        path does not import and ``TypeError`` when the object is not a concrete backend class.
        """
        return resolve_class(self._kind(), self.name, self._provider())

    def is_overridden(self) -> bool:
        """Whether the active container overrides this member's default class."""
        provider = self._provider()
        return provider is not None and bool(provider.overridden)

    def is_registered(self) -> bool:
        """Whether this member resolves to a class in the active container (without importing
        it): always for the built-ins, after registration for ``CUSTOM`` and run-time members."""
        provider = self._provider()
        if provider is None:
            return False
        try:
            class_path(self._kind(), self.name, provider)
        except ValueError:
            return False
        return True

    def clear_override(self) -> None:
        """Drop every override of this member in the active container: a built-in goes back to
        its default class, ``CUSTOM`` and run-time members become unregistered."""
        with REGISTRATION_LOCK:
            provider = self._provider()
            if provider is not None and provider.overridden:
                provider.reset_override()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # By name: several members have the value None.
        return getattr, (type(self), self._name_)


class MLAPrefillBackendEnum(BackendEnum, metaclass=BackendEnumMeta):
    """The MLA prefill backends (``app.catalog.PREFILL_BACKENDS``: the built-ins, then
    ``CUSTOM``, then names registered at run time); each built-in's value is the class path its
    provider imports by default. ``CUSTOM`` (value None, never an alias of another member) is
    the placeholder for a third-party backend and must be registered before use."""

    __kind__ = PREFILL


class MLADecodeBackendEnum(BackendEnum, metaclass=BackendEnumMeta):
    """The MLA decode backends (``app.catalog.DECODE_BACKENDS``), as
    ``MLAPrefillBackendEnum`` is for prefill."""

    __kind__ = DECODE


def _add_member(enum_cls: type[_E], name: str, value: str | None, *, by_value: bool) -> None:
    """Add member ``name`` to ``enum_cls`` (CPython enum surgery, kept here and nowhere else).
    ``by_value``: ``enum_cls(value)`` finds it (only the built-ins and ``CUSTOM``: run-time
    members all have value None, and ``Enum(None)`` stays ``CUSTOM``)."""
    if name in enum_cls.__members__:
        return
    members: Any = enum_cls
    member: Any = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(members._member_names_)
    setattr(members, name, member)
    members._member_map_[name] = member
    members._member_names_.append(name)
    if by_value:
        members._value2member_map_.setdefault(value, member)


def _remove_member(enum_cls: type[_E], name: str) -> None:
    """Drop run-time member ``name`` from ``enum_cls`` (the catalog took the name back: the
    registration that added it was undone)."""
    members: Any = enum_cls
    if name not in members._member_map_:
        return
    del members._member_map_[name]
    members._member_names_.remove(name)
    delattr(members, name)


def _follow_catalog(enum_cls: type[BackendEnum]) -> None:
    """Give ``enum_cls`` a member for every name of its kind's catalog, now and later, and
    drop the members of names the catalog takes back."""
    catalog = enum_cls._kind().catalog
    with catalog.lock:
        for name in catalog:
            builtin = name in catalog.builtins or name == CUSTOM
            _add_member(enum_cls, name, catalog.builtins.get(name), by_value=builtin)
        catalog.on_add(lambda name: _add_member(enum_cls, name, None, by_value=False))
        catalog.on_remove(lambda name: _remove_member(enum_cls, name))


for _enum in (MLAPrefillBackendEnum, MLADecodeBackendEnum):
    _follow_catalog(_enum)
    # A member is an attribute of its enum and a provider of its container: neither may be
    # shadowed by a backend name.
    reserve_names(name for cls in (*inspect.getmro(_enum), *inspect.getmro(BackendEnumMeta))
                  for name in vars(cls))


# -- registering -------------------------------------------------------------------------------

class ClassDecorator(Protocol):
    """What ``register_*_backend`` returns: a class decorator (or a no-op one)."""

    def __call__(self, cls: _C, /) -> _C: ...


def _identity(cls: _C, /) -> _C:
    return cls


def _register(kind: BackendKind, enum_cls: type[BackendEnum], backend: object,
              target: str | type[Any] | None) -> ClassDecorator:
    where = kind.register_name
    if isinstance(backend, enum_cls):
        name, new_name = backend.name, False
    elif isinstance(backend, str):
        name, new_name = backend, True
    else:
        raise TypeError(f"{where}: expected a {kind.enum_name} member or a new backend "
                        f"name, got {backend!r} ({type(backend).__name__})")
    backends = kind.backends_of(active_container())
    if new_name:
        check_new_name(kind, backends, name)
    if target is not None:
        register_backend(kind, backends, name, check_target(kind, target, where),
                         new_name=new_name)
        return _identity

    def register_class(cls: _C, /) -> _C:
        register_backend(kind, backends, name, check_backend_class(kind, cls, where),
                         new_name=new_name)
        return cls

    return register_class


@contextlib.contextmanager
def _override(kind: BackendKind, enum_cls: type[BackendEnum], backend: object,
              target: str | type[Any]) -> Iterator[BackendEnum]:
    if isinstance(backend, str):
        member = enum_cls[backend]
    elif isinstance(backend, enum_cls):
        member = backend
    else:
        raise TypeError(f"{kind.override_name}: expected a {kind.enum_name} member or its "
                        f"name, got {backend!r} ({type(backend).__name__})")
    with override_backend(kind, kind.backends_of(active_container()), member.name, target):
        yield member


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
    return _register(PREFILL, MLAPrefillBackendEnum, backend, class_path)


def override_mla_prefill_backend(
        backend: MLAPrefillBackendEnum | str,
        cls_or_path: str | type[Any]) -> contextlib.AbstractContextManager[BackendEnum]:
    """Override ``backend`` in the active container for the ``with`` block; yields the member.

    On exit, even on an exception, exactly the override this block pushed is removed, wherever
    it sits in the member's override stack: nested blocks restore the state each one entered
    with, and blocks that overlap in different threads of one container never leave an
    override behind. Other members and other containers are untouched.
    """
    return _override(PREFILL, MLAPrefillBackendEnum, backend, cls_or_path)


def register_mla_decode_backend(
        backend: MLADecodeBackendEnum | str,
        class_path: str | type[Any] | None = None) -> ClassDecorator:
    """Register or override an MLA decode backend in the active container (as
    ``register_mla_prefill_backend``; the class must be a concrete ``MLADecodeBackend``)."""
    return _register(DECODE, MLADecodeBackendEnum, backend, class_path)


def override_mla_decode_backend(
        backend: MLADecodeBackendEnum | str,
        cls_or_path: str | type[Any]) -> contextlib.AbstractContextManager[BackendEnum]:
    """Override an MLA decode backend in the active container for the ``with`` block (as
    ``override_mla_prefill_backend``)."""
    return _override(DECODE, MLADecodeBackendEnum, backend, cls_or_path)


# -- selecting ---------------------------------------------------------------------------------

_NOTHING = object()
#: The last answer of each selector: ``(container key, config, query_len, class)``; dropped
#: on every provider change (``_forget``).
_FORGOTTEN: tuple[Any, Any, int, Any] = (_NOTHING, _NOTHING, 0, None)
_last_prefill = _FORGOTTEN
_last_decode = _FORGOTTEN


def _arguments(where: str, config: object, container: object
               ) -> tuple[Any, EngineConfig]:
    """The container (default: the active one) and config (default: its config) a selector
    was given, checked: ``TypeError`` naming the selector, what is expected and what was
    given."""
    c = active_container() if container is None else check_container(
        container, f"{where}: container")
    if config is None:
        return c, c.config()
    if not isinstance(config, EngineConfig):
        raise TypeError(f"{where}: config must be an EngineConfig or None (build one with "
                        f"EngineConfig.from_dict), got {config!r} ({type(config).__name__})")
    return c, config


def _select(kind: BackendKind, where: str, config: EngineConfig | None,
            container: Container | None, **selection_args: Any) -> type[Any]:
    c, checked = _arguments(where, config, container)
    return select_backend(kind, checked, c.platform(), kind.backends_of(c),
                          c.selection_cache(), **selection_args)


def get_mla_prefill_backend(config: EngineConfig | None = None, *,
                            container: Container | None = None
                            ) -> type[MLAPrefillBackend]:
    """The MLA prefill backend class for ``config`` (default: the container's config) on the
    platform of ``container`` (an ``app.containers.Application``, annotated as the
    dependency-injector ``Container`` it is because the composition root sits above this
    module; default: the active container). ``ValueError`` when a forced
    backend is invalid here, or when no backend in the platform's priority list is valid;
    ``TypeError`` for a config that is not an ``EngineConfig`` (or None) or a container that is
    not an ``Application``."""
    key = _active_key() if container is None else container
    last = _last_prefill
    if last[0] is key and last[1] is config:
        found: type[MLAPrefillBackend] = last[3]
        return found
    changes = CHANGES.count
    found = _select(PREFILL, "get_mla_prefill_backend", config, container)
    CHANGES.keep_if_unchanged(changes, lambda: _keep("prefill", (key, config, 1, found)))
    return found


def get_mla_decode_backend(config: EngineConfig | None = None, *, query_len: int = 1,
                           container: Container | None = None) -> type[MLADecodeBackend]:
    """The MLA decode backend class for ``config`` and ``query_len`` (tokens per request per
    step, 1..16; multi-token prediction selects differently) on ``container``'s platform.
    Errors as in ``get_mla_prefill_backend``."""
    key = _active_key() if container is None else container
    last = _last_decode
    if last[0] is key and last[1] is config and last[2] == query_len:
        found: type[MLADecodeBackend] = last[3]
        return found
    changes = CHANGES.count
    found = _select(DECODE, "get_mla_decode_backend", config, container, query_len=query_len)
    CHANGES.keep_if_unchanged(changes, lambda: _keep("decode", (key, config, query_len, found)))
    return found


def _explain(kind: BackendKind, where: str, config: EngineConfig | None,
             container: Container | None, **selection_args: Any) -> SelectionExplanation:
    c, checked = _arguments(where, config, container)
    return explain_selection(kind, checked, c.platform(), kind.backends_of(c),
                             **selection_args)


def explain_mla_prefill_selection(config: EngineConfig | None = None, *,
                                  container: Container | None = None
                                  ) -> SelectionExplanation:
    """Why each prefill backend is or is not valid for ``config`` on ``container``'s platform
    (defaults as in ``get_mla_prefill_backend``), and which one is chosen. Never cached."""
    return _explain(PREFILL, "explain_mla_prefill_selection", config, container)


def explain_mla_decode_selection(config: EngineConfig | None = None, *, query_len: int = 1,
                                 container: Container | None = None
                                 ) -> SelectionExplanation:
    """Why each decode backend is or is not valid (as ``explain_mla_prefill_selection``)."""
    return _explain(DECODE, "explain_mla_decode_selection", config, container,
                    query_len=query_len)


def _keep(what: str, kept: tuple[Any, Any, int, Any]) -> None:
    """Keep a selector's answer (called by ``CHANGES.keep_if_unchanged``, under its lock)."""
    global _last_prefill, _last_decode
    if what == "prefill":
        _last_prefill = kept
    else:
        _last_decode = kept


def _forget() -> None:
    """Drop every kept answer (on every provider change, under the counter's lock)."""
    global _last_prefill, _last_decode
    _last_prefill = _last_decode = _FORGOTTEN


CHANGES.on_change(_forget)
