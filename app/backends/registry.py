"""The backend registry inside one container, written once for both kinds.

A container holds one provider per backend name and kind (``container.mla_prefill_backends``,
``container.mla_decode_backends``); calling a provider gives the backend *class*. Everything
here takes the kind and those providers (``backends``) explicitly and never looks up a
container: the seed API (``app.backends.seed_api``) passes the active container's, a
deployment its own.

- ``BackendKind``: what differs between prefill and decode (base class, catalog, the config
  field that forces one, the platform's priority list, the selector config). ``PREFILL`` and
  ``DECODE`` are the two kinds.
- Resolving: ``resolve_class`` calls a backend's provider and checks it gives a concrete
  subclass of the kind's base; ``class_path`` says where it lives without importing it.
- Registering: ``register_backend`` overrides a backend's provider (a new name is added to the
  kind's catalog first); ``override_backend`` is the scoped form, removing exactly the override
  it pushed. An abstract class, or one whose declarations have the wrong type
  (``declaration_problems()``), is refused (``TypeError``), whatever the kind. Inside
  ``rollback_on_error`` (``app._container_state``) a registration records its undo: the
  override it pushed, the provider it added and, when no other registration holds it, the
  name it added to the catalog are taken back if the block fails.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
from dependency_injector import containers, providers

from app._container_state import CHANGES, CountedObject, record_undo
from app._imports import import_object, object_path
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.prefill.base import MLAPrefillBackend, MLAPrefillSelectorConfig
from app.catalog import CUSTOM, DECODE_BACKENDS, PREFILL_BACKENDS, BackendCatalog

if TYPE_CHECKING:
    from app.config import EngineConfig
    from app.platforms.base import Platform

__all__ = [
    "DECODE",
    "KINDS",
    "PREFILL",
    "REGISTRATION_LOCK",
    "BackendKind",
    "check_backend_class",
    "check_name_form",
    "check_new_name",
    "check_target",
    "class_path",
    "declaration_failure",
    "override_backend",
    "provider_of",
    "register_backend",
    "reserve_names",
    "resolve_class",
    "unregistered_message",
]

logger = logging.getLogger(__name__)

#: Guards every change to a backend provider's override stack made through the registry.
REGISTRATION_LOCK = threading.RLock()


def _names(items: Iterable[Any]) -> list[str]:
    """A platform's priority list as names (a platform may list enum members)."""
    return [item if isinstance(item, str) else getattr(item, "name", item) for item in items]


def _prefill_priorities(platform: Platform, selector_config: Any) -> list[str]:
    return _names(platform.mla_prefill_backend_priorities(selector_config))


def _decode_priorities(platform: Platform, selector_config: Any) -> list[str]:
    return _names(platform.mla_decode_backend_priorities(selector_config))


def _prefill_selector_config(config: EngineConfig, **_: Any) -> MLAPrefillSelectorConfig:
    return MLAPrefillSelectorConfig.from_engine_config(config)


def _decode_selector_config(config: EngineConfig, *, query_len: int = 1,
                            **_: Any) -> MLADecodeSelectorConfig:
    return MLADecodeSelectorConfig.from_engine_config(config, query_len=query_len)


@attrs.frozen(eq=False)
class BackendKind:
    """One kind of backend, as the registry, the selection and the container see it."""

    #: ``"prefill"`` or ``"decode"``.
    name: str
    #: The kind's names (``PREFILL_BACKENDS``); its ``label`` names the kind in messages.
    catalog: BackendCatalog
    #: The base class every backend of the kind subclasses.
    base: type[Any]
    #: The seed API's names, for messages.
    enum_name: str
    register_name: str
    override_name: str
    #: The ``AttentionConfig`` field that forces a backend of this kind.
    config_field: str
    #: ``config -> the backend name it forces`` (None: automatic selection).
    requested: Callable[[EngineConfig], str | None]
    #: ``(platform, selector config) -> names in priority order`` (the platform's method).
    priorities: Callable[[Platform, Any], list[str]]
    #: ``(config, **selection arguments) -> the selector config backends validate against``.
    selector_config: Callable[..., Any]
    #: ``container -> its backend providers of this kind``.
    backends_of: Callable[[Any], Any]

    @property
    def label(self) -> str:
        """How messages name the kind: ``"MLA prefill"``."""
        return self.catalog.label

    def __repr__(self) -> str:
        return f"BackendKind({self.name!r})"


PREFILL = BackendKind(
    name="prefill", catalog=PREFILL_BACKENDS, base=MLAPrefillBackend,
    enum_name="MLAPrefillBackendEnum", register_name="register_mla_prefill_backend",
    override_name="override_mla_prefill_backend", config_field="mla_prefill_backend",
    requested=lambda config: config.attention.mla_prefill_backend,
    priorities=_prefill_priorities, selector_config=_prefill_selector_config,
    backends_of=lambda container: container.mla_prefill_backends())

DECODE = BackendKind(
    name="decode", catalog=DECODE_BACKENDS, base=MLADecodeBackend,
    enum_name="MLADecodeBackendEnum", register_name="register_mla_decode_backend",
    override_name="override_mla_decode_backend", config_field="mla_decode_backend",
    requested=lambda config: config.attention.mla_decode_backend,
    priorities=_decode_priorities, selector_config=_decode_selector_config,
    backends_of=lambda container: container.mla_decode_backends())

#: Every kind, by name.
KINDS: dict[str, BackendKind] = {PREFILL.name: PREFILL, DECODE.name: DECODE}


# -- one backend's provider -------------------------------------------------------------------

def provider_of(backends: Any, name: str) -> providers.Provider[Any] | None:
    """The container's provider for backend ``name`` (None when it has none)."""
    found: providers.Provider[Any] | None = backends.providers.get(name)
    return found


def unregistered_message(kind: BackendKind, name: str, in_container: bool = False) -> str:
    """vLLM's wording for a backend without a class."""
    where = " in the active container" if in_container else ""
    return (f"{kind.label} backend {name} must be registered before use{where}. Use "
            f"{kind.register_name}({kind.enum_name}.{name}, 'your.module.YourClass') or "
            f"decorate the class with @{kind.register_name}({kind.enum_name}.{name})")


def check_backend_class(kind: BackendKind, cls: object, where: str) -> type[Any]:
    """``cls`` if it is a concrete subclass of the kind's base; ``TypeError`` otherwise
    (an abstract class would only fail later, when the engine instantiates it)."""
    base = kind.base.__name__
    if not (isinstance(cls, type) and issubclass(cls, kind.base)):
        raise TypeError(f"{where}: {cls!r} is not an {base} subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TypeError(f"{where}: {object_path(cls)} is abstract (it does not implement "
                        f"{missing}); register a concrete {base} subclass")
    _check_declarations(cls, where)
    return cls


def _check_declarations(cls: type[Any], where: str) -> None:
    """``TypeError`` naming every declaration of ``cls`` that has the wrong type. A class that
    passed is not checked again (selection resolves every candidate on every uncached call,
    and the rules cost ~2 us a class); one changed since, whose ``validate_configuration``
    then fails, is checked again there (``declaration_failure``)."""
    if cls in _declarations_passed:
        return
    error = declaration_failure(cls, where)
    if error is not None:
        raise error
    _declarations_passed.add(cls)


#: The classes whose declarations passed ``_check_declarations``.
_declarations_passed: weakref.WeakSet[type[Any]] = weakref.WeakSet()


def declaration_failure(cls: type[Any], where: str) -> TypeError | None:
    """The ``TypeError`` naming every declaration of ``cls`` that has the wrong type (None:
    none has)."""
    problems = cls.declaration_problems()
    if not problems:
        return None
    return TypeError(f"{where}: {object_path(cls)} declares {'; '.join(problems)}")


def check_target(kind: BackendKind, target: object, where: str) -> str | type[Any]:
    """A class path (checked for form only; imported on first use) or a backend class."""
    if isinstance(target, str):
        module, _, attr = target.replace(":", ".").rpartition(".")
        if not module or not attr:
            raise ValueError(f"{where}: expected a dotted class path like "
                             f"'your.module.YourClass', got {target!r}")
        return target
    if isinstance(target, type):
        return check_backend_class(kind, target, where)
    raise TypeError(f"{where}: expected a class path string or an {kind.base.__name__} "
                    f"subclass, got {target!r} ({type(target).__name__})")


def _effective(provider: providers.Provider[Any]) -> providers.Provider[Any]:
    while True:
        last: providers.Provider[Any] | None = provider.last_overriding
        if last is None:
            return provider
        provider = last


def class_path(kind: BackendKind, name: str, provider: providers.Provider[Any]) -> str:
    """The class path ``provider`` resolves to, without importing it where that can be read.
    ``ValueError`` when it provides nothing (unregistered)."""
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
        raise ValueError(unregistered_message(kind, name))
    if isinstance(obj, str):
        return obj
    if isinstance(obj, type):
        return object_path(obj)
    raise TypeError(f"{kind.label} backend {name} resolves to {obj!r}, which is not a class")


def resolve_class(kind: BackendKind, name: str,
                  provider: providers.Provider[Any] | None) -> type[Any]:
    """Call ``provider`` and check it gives a concrete subclass of the kind's base.

    ``ValueError`` when unregistered (no provider, or it provides None), ``ImportError`` when
    the class does not import, ``TypeError`` when the object is not a backend class.
    """
    if provider is None:
        raise ValueError(unregistered_message(kind, name, in_container=True))
    obj = provider()
    if obj is None:
        raise ValueError(unregistered_message(kind, name))
    if isinstance(obj, str):  # a provider overridden with providers.Object("pkg.mod.Class")
        obj = import_object(obj)
    if not (isinstance(obj, type) and issubclass(obj, kind.base)):
        raise TypeError(f"{kind.label} backend {name} resolves to {obj!r}, which is not an "
                        f"{kind.base.__name__} subclass")
    # A concrete subclass of the (ABC) base has an empty ``__abstractmethods__``: the same
    # answer as ``inspect.isabstract``, at a fraction of its cost on this per-selection path.
    if getattr(obj, "__abstractmethods__", None):
        check_backend_class(kind, obj, f"{kind.label} backend {name}")  # raises, saying why
    # A class path is checked only now (a class changed since: see _check_declarations).
    _check_declarations(obj, f"{kind.label} backend {name}")
    return obj


# -- registering ------------------------------------------------------------------------------

_reserved: set[str] = set(dir(containers.DynamicContainer()))


def reserve_names(names: Iterable[str]) -> None:
    """Names no backend may take (a backend's provider is an attribute of its container, and
    the seed API's enum reserves its own attributes)."""
    with REGISTRATION_LOCK:
        _reserved.update(names)


def check_name_form(kind: BackendKind, name: object) -> None:
    """``ValueError`` unless ``name`` may become a new name of the kind in any container: an
    identifier like 'MY_BACKEND', not a keyword, not starting with '_' and, unless the kind's
    catalog has it already, not reserved. What a deployment checks before it builds anything."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
            or name.startswith("_"):
        raise ValueError(f"Invalid {kind.label} backend name: {name!r} (expected an "
                         f"identifier like 'MY_BACKEND', not starting with '_')")
    if name not in kind.catalog and name in _reserved:
        raise ValueError(f"Invalid {kind.label} backend name: {name!r} is reserved")


def check_new_name(kind: BackendKind, backends: Any, name: str) -> None:
    """``ValueError`` unless ``name`` can be registered by name in ``backends``: a valid,
    unreserved identifier that is not a built-in and not already registered there (a name
    added in another container may be registered here by name)."""
    check_name_form(kind, name)
    if name in kind.catalog:
        provider = provider_of(backends, name)
        if name in kind.catalog.builtins or name == CUSTOM \
                or (provider is not None and provider.overridden):
            raise ValueError(
                f"{kind.label} backend {name} already exists in {kind.enum_name}. Use "
                f"{kind.register_name}({kind.enum_name}.{name}, 'your.module.YourClass') to "
                f"override it.")


def _overriding_provider(target: str | type[Any]) -> providers.Provider[Any]:
    """The provider a registration pushes: imports a path on first use, or gives the class."""
    if isinstance(target, str):
        return providers.Callable(import_object, target)
    return providers.Object(target)


def _provider_for(backends: Any, name: str) -> tuple[providers.Provider[Any], bool]:
    """``name``'s provider in ``backends``, added (unregistered) when it has none; whether it
    was added. The caller holds ``REGISTRATION_LOCK``."""
    provider = provider_of(backends, name)
    if provider is not None:
        return provider, False
    added: providers.Provider[Any] = CountedObject(None)
    backends.set_provider(name, added)
    CHANGES.bump()
    return added, True


def register_backend(kind: BackendKind, backends: Any, name: str, target: str | type[Any], *,
                     new_name: bool = False) -> None:
    """Override backend ``name`` among ``backends`` with ``target`` (a checked class or a class
    path, imported on first use). ``new_name``: ``name`` is a name to add to the kind's
    catalog (``ValueError`` when it is not a valid, free name); otherwise it must be one
    already (``ValueError`` listing the valid names)."""
    where = kind.register_name
    checked = check_target(kind, target, where)
    overriding = _overriding_provider(checked)
    with kind.catalog.lock, REGISTRATION_LOCK:
        added_name = False
        if new_name:
            check_new_name(kind, backends, name)
            if name not in kind.catalog:
                kind.catalog.add(name)
                added_name = True
                logger.info("Added %s backend %s", kind.label, name)
        else:
            name = kind.catalog.resolve(name)
        held = name not in kind.catalog.builtins and name != CUSTOM
        if held:
            _holders[kind.name, name] = _holders.get((kind.name, name), 0) + 1
        provider, created = _provider_for(backends, name)
        provider.override(overriding)
    record_undo(lambda: _unregister(kind, backends, name, provider, overriding, created=created,
                                    held=held, added_name=added_name))
    logger.info("Registered %s backend %s -> %s", kind.label, name,
                checked if isinstance(checked, str) else object_path(checked))


#: ``(kind, run-time name) -> how many registrations hold it`` (in any container): a name
#: added by a registration that is taken back leaves the catalog only when no other
#: registration has come to hold it meanwhile.
_holders: dict[tuple[str, str], int] = {}


def _unregister(kind: BackendKind, backends: Any, name: str,
                provider: providers.Provider[Any], overriding: providers.Provider[Any], *,
                created: bool, held: bool, added_name: bool) -> None:
    """Take back one ``register_backend``: the override it pushed, the provider it added (when
    nothing else overrides it now) and the catalog name it added (when nothing holds it)."""
    with kind.catalog.lock, REGISTRATION_LOCK:
        if provider_of(backends, name) is provider:
            _remove_overriding(provider, overriding)
            if created and not provider.overridden:
                delattr(backends, name)
                CHANGES.bump()
        if held:
            count = _holders.get((kind.name, name), 0) - 1
            if count > 0:
                _holders[kind.name, name] = count
            else:
                _holders.pop((kind.name, name), None)
                if added_name:
                    kind.catalog.remove(name)
                    logger.info("Removed %s backend %s (its registration was taken back)",
                                kind.label, name)


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


@contextlib.contextmanager
def override_backend(kind: BackendKind, backends: Any, name: str,
                     target: str | type[Any]) -> Iterator[str]:
    """Override backend ``name`` (one of the kind's names) among ``backends`` for the ``with``
    block; yields the name. On exit, even on an exception, exactly the override it pushed is
    removed, wherever it sits in the provider's override stack."""
    name = kind.catalog.resolve(name)
    overriding = _overriding_provider(check_target(kind, target, kind.override_name))
    with REGISTRATION_LOCK:
        provider, created = _provider_for(backends, name)
        provider.override(overriding)
    try:
        yield name
    finally:
        with REGISTRATION_LOCK:
            if provider_of(backends, name) is provider:
                _remove_overriding(provider, overriding)
                if created and not provider.overridden:
                    delattr(backends, name)
                    CHANGES.bump()
