"""The MLA prefill backend registry: ``MLAPrefillBackendEnum`` over the container's providers.

Every member names one provider of the *active* container (``container.mla_prefill_backends.
<NAME>``); calling the provider gives the backend class. Nothing here is a module-global
mapping of overrides: ``register_mla_prefill_backend`` overrides the member's provider in the
active container, ``clear_override`` resets it and ``is_overridden`` asks it, so a fresh
container (or one made active with ``use_container``) sees none of another container's
registrations.

- ``register_mla_prefill_backend(member, "pkg.mod.Class")`` overrides at once (the class is
  imported on first use); ``@register_mla_prefill_backend(member)`` records the decorated class
  itself (so classes defined in a function work too); ``register_mla_prefill_backend("NAME",
  ...)`` adds a new member to the enum at run time. The member exists everywhere from then on,
  but only the containers it was registered in have a class for it; elsewhere it "must be
  registered before use" (by member, or by name again).
- ``with override_mla_prefill_backend(member, cls_or_path): ...`` is the scoped form: on exit
  (even on an exception) the member's registration in that container is put back exactly as it
  was on entry.

Registration and selection bookkeeping of a container (``RegistryState``) are guarded by the
container's ``registry_lock``; adding enum members is guarded by a module lock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import keyword
import logging
import threading
from collections.abc import Iterator
from enum import Enum, EnumMeta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dependency_injector import containers, providers

from app._imports import import_object, object_path
from app.backends.base import MLAPrefillBackend
from app.containers import BUILTIN_MLA_PREFILL_BACKENDS, get_container

if TYPE_CHECKING:
    from app.containers import Application
    from app.platforms import Platform

__all__ = [
    "ClassDecorator",
    "MLAPrefillBackendEnum",
    "RegistryState",
    "get_registry_state",
    "override_mla_prefill_backend",
    "register_mla_prefill_backend",
    "resolve_backend_class",
]

logger = logging.getLogger(__name__)

_E = TypeVar("_E", bound=Enum)
_C = TypeVar("_C", bound=type)

#: The attribute of a container that holds its bound ``RegistryState`` (a plain reference, so
#: the selector's hot path needs no provider call).
STATE_ATTR = "_app_mla_prefill_registry_state"

_members_lock = threading.Lock()
_bind_lock = threading.Lock()


class _MLAPrefillBackendEnumMeta(EnumMeta):
    """``MLAPrefillBackendEnum["NAME"]`` raises ``ValueError`` listing the valid names."""

    def __getitem__(cls: type[_E], name: str) -> _E:  # type: ignore[misc]
        try:
            return cls._member_map_[name]  # type: ignore[return-value]
        except (KeyError, TypeError):
            valid = ", ".join(cls._member_names_)
            raise ValueError(f"Unknown MLA prefill backend: '{name}'. "
                             f"Valid options are: {valid}") from None


class MLAPrefillBackendEnum(Enum, metaclass=_MLAPrefillBackendEnumMeta):
    """The MLA prefill backends; each value is the class path its provider imports by default.

    ``CUSTOM`` (value None, never an alias of another member) is a placeholder for a third-party
    backend and must be registered before use. Members added with
    ``register_mla_prefill_backend("NAME", ...)`` have value None as well: their class lives
    only in the containers they were registered in.
    """

    TORCH_SDPA = BUILTIN_MLA_PREFILL_BACKENDS["TORCH_SDPA"]
    FLASH_ATTN = BUILTIN_MLA_PREFILL_BACKENDS["FLASH_ATTN"]
    FLASHINFER = BUILTIN_MLA_PREFILL_BACKENDS["FLASHINFER"]
    TRTLLM_RAGGED = BUILTIN_MLA_PREFILL_BACKENDS["TRTLLM_RAGGED"]
    TOKENSPEED_MLA = BUILTIN_MLA_PREFILL_BACKENDS["TOKENSPEED_MLA"]
    # None, not "": a value no other member has, so CUSTOM is never an alias of one.
    CUSTOM = None

    def get_path(self) -> str:
        """The dotted path of the class this member resolves to in the active container
        (overrides honoured). ``ValueError`` when the member is not registered there."""
        provider = get_registry_state().provider(self.name)
        if provider is None:
            raise ValueError(_unregistered_message(self.name, in_container=True))
        return _provider_path(self.name, provider)

    def get_class(self) -> type[MLAPrefillBackend]:
        """The backend class in the active container, imported on first use.

        Raises ``ValueError`` when the member is not registered there, ``ImportError`` when its
        path does not import and ``TypeError`` when the object is not an ``MLAPrefillBackend``
        subclass.
        """
        return resolve_backend_class(self.name, get_registry_state().provider(self.name))

    def is_overridden(self) -> bool:
        """Whether the active container overrides this member's default class."""
        provider = get_registry_state().provider(self.name)
        return provider is not None and bool(provider.overridden)

    def is_registered(self) -> bool:
        """Whether this member resolves to a class in the active container (without importing
        it): always for the built-ins, after registration for ``CUSTOM`` and run-time members."""
        provider = get_registry_state().provider(self.name)
        if provider is None:
            return False
        try:
            _provider_path(self.name, provider)
        except ValueError:
            return False
        return True

    def clear_override(self) -> None:
        """Drop every override of this member in the active container: a built-in goes back to
        its default class, ``CUSTOM`` and run-time members become unregistered."""
        state = get_registry_state()
        with state.lock:
            provider = state.provider(self.name)
            if provider is not None and provider.overridden:
                provider.reset_override()
                state.bump()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # By name: several members have the value None.
        return getattr, (type(self), self._name_)


#: The members defined above (run-time members are added after these).
_BUILTIN_NAMES = frozenset(MLAPrefillBackendEnum.__members__)


class _CacheEntry:
    """A remembered selection: valid while the platform is the same object and every provider
    the selection consulted still has the same last overriding provider."""

    __slots__ = ("cls", "config", "name", "platform", "tokens")

    def __init__(self, config: Any, platform: Platform, cls: type[MLAPrefillBackend],
                 name: str, tokens: tuple[tuple[providers.Provider[Any],
                                                providers.Provider[Any] | None], ...]) -> None:
        self.config = config
        self.platform = platform
        self.cls = cls
        self.name = name
        self.tokens = tokens


class RegistryState:
    """The mutable registry bookkeeping of one container (its ``registry_state`` singleton).

    Holds plain references to the container's lock and providers (resolved once, in ``bind``),
    an override ``generation`` bumped by every registration change made through this module,
    and the selector's cache. Use ``get_registry_state(container)`` to get a container's bound
    state.
    """

    def __init__(self) -> None:
        self.generation = 0
        #: Selections computed (cache misses), for diagnostics and benchmarks.
        self.selections = 0
        self.owner: Application | None = None
        self.lock: Any = threading.RLock()
        self._backends: Any = None
        self._providers: dict[str, providers.Provider[Any]] = {}
        self.platform_provider: Any = None
        self.config_provider: Any = None
        #: ``id(config)`` -> entry (the entry keeps the config alive, so the id stays unique).
        self.by_config: dict[int, _CacheEntry] = {}
        #: (explicit backend, dtype, dims, platform) -> entry, for equal but distinct configs.
        self.by_key: dict[tuple[Any, ...], _CacheEntry] = {}

    def bind(self, container: Application) -> None:
        """Attach to ``container``: take its lock and the providers the selector reads."""
        self.owner = container
        self.lock = container.registry_lock()
        self._backends = container.mla_prefill_backends.container
        self._providers = self._backends.providers
        self.platform_provider = container.platform
        self.config_provider = container.config

    def provider(self, name: str) -> providers.Provider[Any] | None:
        """The container's provider for backend ``name`` (None when it has none)."""
        return self._providers.get(name)

    def backend_names(self) -> list[str]:
        """The names of the backends this container has a provider for."""
        return list(self._providers)

    def add_provider(self, name: str) -> providers.Provider[Any]:
        """Give the container an (unregistered) provider for a run-time member."""
        provider: providers.Provider[Any] = providers.Object(None)
        self._backends.set_provider(name, provider)
        return provider

    def remove_provider(self, name: str) -> None:
        """Remove a run-time member's provider again (the scoped override's undo)."""
        delattr(self._backends, name)

    def bump(self) -> None:
        """Record a registration change: new generation, empty selection cache."""
        with self.lock:
            self.generation += 1
            self.by_config.clear()
            self.by_key.clear()

    def __repr__(self) -> str:
        return (f"RegistryState(generation={self.generation}, cached={len(self.by_key)}, "
                f"selections={self.selections})")


def get_registry_state(container: Application | None = None) -> RegistryState:
    """The bound ``RegistryState`` of ``container`` (default: the active container)."""
    if container is None:
        container = get_container()
    state: RegistryState | None = getattr(container, STATE_ATTR, None)
    if state is not None and state.owner is container:
        return state
    return _bind_state(container)


def _bind_state(container: Application) -> RegistryState:
    with _bind_lock:
        state: RegistryState | None = getattr(container, STATE_ATTR, None)
        if state is not None and state.owner is container:
            return state
        state = container.registry_state()
        if not isinstance(state, RegistryState):
            raise TypeError(f"the container's registry_state provider must provide a "
                            f"RegistryState, got {state!r}")
        if state.owner is not container:
            state.bind(container)
        setattr(container, STATE_ATTR, state)
        return state


def _unregistered_message(name: str, in_container: bool = False) -> str:
    where = " in the active container" if in_container else ""
    return (f"MLA prefill backend {name} must be registered before use{where}. Use "
            f"register_mla_prefill_backend(MLAPrefillBackendEnum.{name}, "
            f"'your.module.YourClass') or decorate the class with "
            f"@register_mla_prefill_backend(MLAPrefillBackendEnum.{name})")


def _effective(provider: providers.Provider[Any]) -> providers.Provider[Any]:
    while True:
        last: providers.Provider[Any] | None = provider.last_overriding
        if last is None:
            return provider
        provider = last


def _provider_path(name: str, provider: providers.Provider[Any]) -> str:
    """The class path ``provider`` resolves to, without importing it where that can be read."""
    effective = _effective(provider)
    obj: Any
    if isinstance(effective, providers.Object):
        obj = effective.provides
    elif (isinstance(effective, providers.Callable) and effective.provides is import_object
          and len(effective.args) == 1 and isinstance(effective.args[0], str)
          and not effective.kwargs):
        return str(effective.args[0])
    else:
        obj = provider()
    if obj is None:
        raise ValueError(_unregistered_message(name))
    if isinstance(obj, str):
        return obj
    if isinstance(obj, type):
        return object_path(obj)
    raise TypeError(f"MLA prefill backend {name} resolves to {obj!r}, which is not a class")


def resolve_backend_class(name: str, provider: providers.Provider[Any] | None
                          ) -> type[MLAPrefillBackend]:
    """Call ``provider`` and check it gives an ``MLAPrefillBackend`` subclass.

    ``ValueError`` when unregistered (no provider, or it provides None), ``ImportError`` when
    the class does not import, ``TypeError`` when the object is not a backend class.
    """
    if provider is None:
        raise ValueError(_unregistered_message(name, in_container=True))
    obj = provider()
    if obj is None:
        raise ValueError(_unregistered_message(name))
    if isinstance(obj, str):  # a provider overridden with providers.Object("pkg.mod.Class")
        obj = import_object(obj)
    if not (isinstance(obj, type) and issubclass(obj, MLAPrefillBackend)):
        raise TypeError(f"MLA prefill backend {name} resolves to {obj!r}, which is not an "
                        f"MLAPrefillBackend subclass")
    return obj


def _check_class(cls: object, where: str) -> type[MLAPrefillBackend]:
    if not (isinstance(cls, type) and issubclass(cls, MLAPrefillBackend)):
        raise TypeError(f"{where}: {cls!r} is not an MLAPrefillBackend subclass")
    return cls


def _check_target(target: object, where: str) -> str | type[MLAPrefillBackend]:
    """A class path (checked for form only; imported on first use) or a backend class."""
    if isinstance(target, str):
        module, _, attr = target.replace(":", ".").rpartition(".")
        if not module or not attr:
            raise ValueError(f"{where}: expected a dotted class path like "
                             f"'your.module.YourClass', got {target!r}")
        return target
    if isinstance(target, type):
        return _check_class(target, where)
    raise TypeError(f"{where}: expected a class path string or an MLAPrefillBackend subclass, "
                    f"got {target!r} ({type(target).__name__})")


def _overriding_provider(target: str | type[MLAPrefillBackend]) -> providers.Provider[Any]:
    if isinstance(target, str):
        return providers.Callable(import_object, target)
    return providers.Object(target)


def _check_new_name(name: str) -> None:
    """``ValueError`` unless ``name`` can be registered by name in the active container: a
    valid, unreserved identifier that is not a built-in member and not already registered
    there (a run-time member added in another container may be registered here by name)."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
            or name.startswith("_"):
        raise ValueError(f"Invalid MLA prefill backend name: {name!r} (expected an identifier "
                         f"like 'MY_BACKEND', not starting with '_')")
    if name in MLAPrefillBackendEnum.__members__:
        provider = get_registry_state().provider(name)
        if name in _BUILTIN_NAMES or (provider is not None and provider.overridden):
            raise ValueError(
                f"MLA prefill backend {name} already exists in MLAPrefillBackendEnum. Use "
                f"register_mla_prefill_backend(MLAPrefillBackendEnum.{name}, "
                f"'your.module.YourClass') to override it.")
        return
    if name in _reserved_names():
        raise ValueError(f"Invalid MLA prefill backend name: {name!r} is reserved")


@functools.cache
def _reserved_names() -> frozenset[str]:
    """Names a member must not take: attributes of the enum class, its metaclass and of a
    container (a member's provider is an attribute of the backends container)."""
    classes = inspect.getmro(MLAPrefillBackendEnum) + inspect.getmro(_MLAPrefillBackendEnumMeta)
    return (frozenset(name for cls in classes for name in vars(cls))
            | frozenset(dir(containers.DynamicContainer())))


def _add_member(name: str) -> MLAPrefillBackendEnum:
    """Member ``name``, added to ``MLAPrefillBackendEnum`` (value None) if it is new.
    The caller holds ``_members_lock`` and has checked the name."""
    existing = MLAPrefillBackendEnum.__members__.get(name)
    if existing is not None:
        return existing
    enum_cls: Any = MLAPrefillBackendEnum
    member: Any = object.__new__(MLAPrefillBackendEnum)
    member._name_ = name
    member._value_ = None
    member._sort_order_ = len(enum_cls._member_names_)
    # Not in _value2member_map_: MLAPrefillBackendEnum(None) stays CUSTOM.
    setattr(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    logger.info("Added MLA prefill backend %s", name)
    added: MLAPrefillBackendEnum = member
    return added


def _register_by_name(name: str, target: str | type[MLAPrefillBackend]) -> None:
    with _members_lock:
        _check_new_name(name)
        _register(_add_member(name), target)


def _register(member: MLAPrefillBackendEnum, target: str | type[MLAPrefillBackend]) -> None:
    state = get_registry_state()
    with state.lock:
        provider = state.provider(member.name)
        if provider is None:
            provider = state.add_provider(member.name)
        provider.override(_overriding_provider(target))
        state.bump()
    logger.info("Registered MLA prefill backend %s -> %s", member.name,
                target if isinstance(target, str) else object_path(target))


class ClassDecorator(Protocol):
    """What ``register_mla_prefill_backend`` returns: a class decorator (or a no-op one)."""

    def __call__(self, cls: _C, /) -> _C: ...


def _identity(cls: _C, /) -> _C:
    return cls


def register_mla_prefill_backend(
        backend: MLAPrefillBackendEnum | str,
        class_path: str | type[MLAPrefillBackend] | None = None) -> ClassDecorator:
    """Register or override an MLA prefill backend in the active container.

    - ``register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "my.mod.MyBackend")``:
      overrides at once (the class is imported on first use); returns a no-op decorator.
    - ``@register_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER)`` on a class: records
      that class (``TypeError`` if it is not an ``MLAPrefillBackend`` subclass).
    - ``register_mla_prefill_backend("MY_BACKEND", path_or_class)`` or
      ``@register_mla_prefill_backend("MY_BACKEND")``: adds member ``MY_BACKEND`` to
      ``MLAPrefillBackendEnum`` and registers it in the active container. ``ValueError`` for a
      non-identifier or reserved name and for a duplicate: a built-in member's name, or a name
      already registered in the active container (a run-time member added in *another*
      container is registered here by name, so a plugin can run once per container).

    ``class_path`` may also be the class itself. Thread-safe.
    """
    where = "register_mla_prefill_backend"
    if isinstance(backend, str):
        _check_new_name(backend)
        register = functools.partial(_register_by_name, backend)
    elif isinstance(backend, MLAPrefillBackendEnum):
        register = functools.partial(_register, backend)
    else:
        raise TypeError(f"{where}: expected an MLAPrefillBackendEnum member or a new backend "
                        f"name, got {backend!r} ({type(backend).__name__})")
    if class_path is not None:
        register(_check_target(class_path, where))
        return _identity

    def register_class(cls: _C, /) -> _C:
        register(_check_class(cls, where))
        return cls

    return register_class


def _as_member(backend: MLAPrefillBackendEnum | str, where: str) -> MLAPrefillBackendEnum:
    if isinstance(backend, MLAPrefillBackendEnum):
        return backend
    if isinstance(backend, str):
        return MLAPrefillBackendEnum[backend]
    raise TypeError(f"{where}: expected an MLAPrefillBackendEnum member or its name, "
                    f"got {backend!r} ({type(backend).__name__})")


@contextlib.contextmanager
def override_mla_prefill_backend(
        backend: MLAPrefillBackendEnum | str,
        cls_or_path: str | type[MLAPrefillBackend]) -> Iterator[MLAPrefillBackendEnum]:
    """Override ``backend`` in the active container for the ``with`` block; yields the member.

    On exit, even on an exception, exactly the override this block pushed is removed, wherever
    it sits in the member's override stack. Nested blocks therefore restore the state each one
    entered with, and blocks that overlap in different threads of one container never leave an
    override behind. A permanent ``register_mla_prefill_backend`` made inside the block stays;
    ``clear_override`` inside the block clears this block's override too. Other members and
    other containers are untouched.
    """
    where = "override_mla_prefill_backend"
    member = _as_member(backend, where)
    target = _check_target(cls_or_path, where)
    state = get_registry_state()
    overriding = _overriding_provider(target)
    with state.lock:
        provider = state.provider(member.name)
        created = provider is None
        if provider is None:
            provider = state.add_provider(member.name)
        provider.override(overriding)
        state.bump()
    try:
        yield member
    finally:
        with state.lock:
            if state.provider(member.name) is provider:
                _remove_overriding(provider, overriding)
                if created and not provider.overridden:
                    state.remove_provider(member.name)
            state.bump()


def _remove_overriding(provider: providers.Provider[Any],
                       overriding: providers.Provider[Any]) -> None:
    """Remove one overriding provider (by identity) from ``provider``'s override stack."""
    current: tuple[providers.Provider[Any], ...] = provider.overridden
    if not any(p is overriding for p in current):
        return
    if current[-1] is overriding:
        provider.reset_last_overriding()
        return
    provider.reset_override()
    for p in current:
        if p is not overriding:
            provider.override(p)
