"""The backend enums' machinery: vLLM's error wording, members added at run time, and the
seed-API methods (``get_class``, ``get_path`` ...) that act on the *active* container.

An enum class names its kind in ``__kind__``; its members mirror ``kind.names`` (built-ins from
the kind's table, ``CUSTOM``, then run-time additions made by ``add_member``). Adding a member
is CPython enum surgery, kept here and nowhere else.
"""

from __future__ import annotations

import logging
from enum import Enum, EnumMeta
from typing import Any, TypeVar

import app.backends._providers as _providers
from app.backends.kinds import BackendKind
from app.backends.table import CUSTOM

__all__ = ["BackendEnum", "BackendEnumMeta", "active_backends", "add_member", "populate"]

logger = logging.getLogger(__name__)

_E = TypeVar("_E", bound=Enum)


def active_backends(kind: BackendKind) -> Any:
    """The active container's backends of ``kind`` (its ``mla_*_backends`` provider, called).

    The seed-API facades are the only callers: nothing inside the library uses the active
    container.
    """
    from app.containers import get_container

    return getattr(get_container(), kind.container_attr)()


class BackendEnumMeta(EnumMeta):
    """``Enum["NAME"]`` raises ``ValueError`` listing the valid names (vLLM's wording)."""

    def __getitem__(cls: type[_E], name: str) -> _E:  # type: ignore[misc]
        try:
            return cls._member_map_[name]  # type: ignore[return-value]
        except (KeyError, TypeError):
            kind: BackendKind = cls.__kind__  # type: ignore[attr-defined]
            raise ValueError(kind.names.unknown_message(name)) from None


class BackendEnum(Enum, metaclass=BackendEnumMeta):
    """Base of ``MLAPrefillBackendEnum`` and ``MLADecodeBackendEnum``: each value is the class
    path a built-in's provider imports by default (None for ``CUSTOM`` and run-time members,
    whose class lives only in the containers they were registered in)."""

    @classmethod
    def _kind(cls) -> BackendKind:
        kind: BackendKind = cls.__kind__  # type: ignore[attr-defined]
        return kind

    def get_path(self) -> str:
        """The dotted path of the class this member resolves to in the active container
        (overrides honoured). ``ValueError`` when the member is not registered there."""
        kind = self._kind()
        provider = _providers.provider_of(active_backends(kind), self.name)
        if provider is None:
            raise ValueError(_providers.unregistered_message(kind, self.name, in_container=True))
        return _providers.class_path(kind, self.name, provider)

    def get_class(self) -> type[Any]:
        """The backend class in the active container, imported on first use.

        Raises ``ValueError`` when the member is not registered there, ``ImportError`` when its
        path does not import and ``TypeError`` when the object is not a concrete backend class.
        """
        kind = self._kind()
        return _providers.resolve_class(kind, self.name,
                                        _providers.provider_of(active_backends(kind), self.name))

    def is_overridden(self) -> bool:
        """Whether the active container overrides this member's default class."""
        provider = _providers.provider_of(active_backends(self._kind()), self.name)
        return provider is not None and bool(provider.overridden)

    def is_registered(self) -> bool:
        """Whether this member resolves to a class in the active container (without importing
        it): always for the built-ins, after registration for ``CUSTOM`` and run-time members."""
        kind = self._kind()
        provider = _providers.provider_of(active_backends(kind), self.name)
        if provider is None:
            return False
        try:
            _providers.class_path(kind, self.name, provider)
        except ValueError:
            return False
        return True

    def clear_override(self) -> None:
        """Drop every override of this member in the active container: a built-in goes back to
        its default class, ``CUSTOM`` and run-time members become unregistered."""
        with _providers.REGISTRATION_LOCK:
            provider = _providers.provider_of(active_backends(self._kind()), self.name)
            if provider is not None and provider.overridden:
                provider.reset_override()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # By name: several members have the value None.
        return getattr, (type(self), self._name_)


def add_member(enum_cls: type[_E], name: str, value: str | None = None, *,
               by_value: bool = False) -> _E:
    """Member ``name`` of ``enum_cls``, added (with ``value``) if it is new; its kind's names
    gain it too. ``by_value``: ``enum_cls(value)`` finds it (only the table's members and
    ``CUSTOM``: run-time members all have value None, and ``Enum(None)`` stays ``CUSTOM``).
    The caller has checked the name."""
    kind: BackendKind = enum_cls.__kind__  # type: ignore[attr-defined]
    with kind.names.lock:
        existing = enum_cls.__members__.get(name)
        if existing is not None:
            return existing
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
        kind.names.add(name)
        added: _E = member
        return added


def populate(enum_cls: type[BackendEnum]) -> None:
    """Give a new backend enum its kind's table members, then ``CUSTOM``."""
    kind = enum_cls._kind()
    for entry in kind.table:
        add_member(enum_cls, entry.name, entry.class_path, by_value=True)
    add_member(enum_cls, CUSTOM, None, by_value=True)
    logger.debug("%s: %s", kind.enum_name, list(enum_cls.__members__))
