"""One kind's backend providers in one container: resolving, checking and overriding them.

Every function takes the kind and the container's backends sub-container (``DynamicContainer``
with one provider per backend name) explicitly: nothing here looks up a container. The
registry (``app.backends.registry``) and the selection (``app.backends.selection``) build on
these.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from dependency_injector import providers

from app._imports import import_object, object_path
from app.backends.kinds import BackendKind

__all__ = [
    "REGISTRATION_LOCK",
    "add_provider",
    "check_backend_class",
    "check_target",
    "class_path",
    "overriding_provider",
    "provider_of",
    "remove_overriding",
    "resolve_class",
    "unregistered_message",
]

#: Guards every change to a provider's override stack made through the registry (registration
#: is rare; selection never takes it).
REGISTRATION_LOCK = threading.RLock()


def provider_of(backends: Any, name: str) -> providers.Provider[Any] | None:
    """The container's provider for backend ``name`` (None when it has none)."""
    found: providers.Provider[Any] | None = backends.providers.get(name)
    return found


def add_provider(backends: Any, name: str) -> providers.Provider[Any]:
    """Give the container an (unregistered) provider for a run-time member."""
    provider: providers.Provider[Any] = providers.Object(None)
    backends.set_provider(name, provider)
    return provider


def remove_provider(backends: Any, name: str) -> None:
    """Remove a run-time member's provider again (a scoped override's undo)."""
    delattr(backends, name)


def unregistered_message(kind: BackendKind, name: str, in_container: bool = False) -> str:
    """vLLM's wording for a member without a class."""
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
    return cls


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


def overriding_provider(target: str | type[Any]) -> providers.Provider[Any]:
    """The provider a registration pushes: imports a path on first use, or gives the class."""
    if isinstance(target, str):
        return providers.Callable(import_object, target)
    return providers.Object(target)


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
    return check_backend_class(kind, obj, f"{kind.label} backend {name}")


def remove_overriding(provider: providers.Provider[Any],
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
