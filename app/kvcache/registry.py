"""``KVCacheSpecRegistry``: vLLM's classmethod facade over the *active* container's
``KVCacheSpecBindings`` (``app.kvcache.bindings``), and the ``register_kv_cache_spec`` decorator.

The seed API lives here, at the edge: every call resolves the active container
(``app.containers.get_container()``; ``use_container`` isolates tests and deployments). The
library's own services never call it: the container passes them its bindings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from app.kvcache.bindings import (
    KVCacheSpecBindings,
    KVCacheSpecMetadata,
    iter_bindings,
    register_builtin_kv_cache_specs,
)
from app.kvcache.specs import KVCacheSpec

if TYPE_CHECKING:
    from app.kvcache.managers import SingleTypeKVCacheManager

__all__ = [
    "KVCacheSpecBindings",
    "KVCacheSpecMetadata",
    "KVCacheSpecRegistry",
    "iter_bindings",
    "register_builtin_kv_cache_specs",
    "register_kv_cache_spec",
]

SpecT = TypeVar("SpecT", bound=type[KVCacheSpec])


def _active_bindings() -> KVCacheSpecBindings:
    """The active container's bindings (its ``kv_cache_spec_bindings`` provider, called)."""
    from app.containers import get_container

    bindings = get_container().kv_cache_spec_bindings()
    if not isinstance(bindings, KVCacheSpecBindings):
        raise TypeError("the container's kv_cache_spec_bindings provider must provide "
                        f"KVCacheSpecBindings, got {bindings!r}")
    return bindings


class KVCacheSpecRegistry:
    """The facade over the active container's ``KVCacheSpecBindings`` (vLLM's API).

    Every classmethod resolves the active container (``use_container`` picks another one) and
    calls its ``kv_cache_spec_bindings`` provider, so an override of that provider takes
    effect at once. Nothing inside the library calls it: services get their bindings passed in.
    """

    @classmethod
    def bindings(cls) -> KVCacheSpecBindings:
        """The active container's bindings, built-ins and platform hook done."""
        bindings = _active_bindings()
        bindings.ensure_ready()
        return bindings

    @classmethod
    def register(cls, kv_cache_spec_cls: type[KVCacheSpec],
                 manager_class: type[SingleTypeKVCacheManager] | None = None,
                 uniform_type_base_spec: type[KVCacheSpec] | None = None) -> None:
        """Bind a spec type in the active container (see ``KVCacheSpecBindings.register``)."""
        _active_bindings().register(kv_cache_spec_cls, manager_class, uniform_type_base_spec)

    @classmethod
    def get_manager_class(cls, kv_cache_spec: KVCacheSpec
                          ) -> type[SingleTypeKVCacheManager] | None:
        """The manager class bound to ``kv_cache_spec``'s type (or a base in its MRO)."""
        return _active_bindings().get_manager_class(kv_cache_spec)

    @classmethod
    def get_uniform_type_base_spec(cls, kv_cache_spec: KVCacheSpec
                                   ) -> type[KVCacheSpec] | None:
        """The uniform base spec bound to ``kv_cache_spec``'s type (or a base in its MRO)."""
        return _active_bindings().get_uniform_type_base_spec(kv_cache_spec)

    @classmethod
    def get_metadata(cls, kv_cache_spec: KVCacheSpec | type[KVCacheSpec]
                     ) -> KVCacheSpecMetadata | None:
        """The binding that applies to a spec or spec type, or None."""
        return _active_bindings().get_metadata(kv_cache_spec)

    @classmethod
    def check_kv_cache_spec_registry(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> None:
        """``ValueError`` naming every layer whose spec type is not registered."""
        _active_bindings().check_kv_cache_spec_registry(kv_cache_specs)

    @classmethod
    def registered_specs(cls) -> dict[type[KVCacheSpec], KVCacheSpecMetadata]:
        """A copy of the active container's bindings."""
        return _active_bindings().registered_specs()


def register_kv_cache_spec(
        manager_class: type[SingleTypeKVCacheManager] | None = None,
        uniform_type_base_spec: type[KVCacheSpec] | None = None) -> Callable[[SpecT], SpecT]:
    """Class decorator: register the decorated spec in the active container.

    ::

        @register_kv_cache_spec(manager_class=FullAttentionManager,
                                uniform_type_base_spec=FullAttentionSpec)
        @attrs.frozen(kw_only=True)
        class MyFullAttentionSpec(FullAttentionSpec): ...

    A decorator at module level registers into whichever container is active when the module
    is imported; specs that every container must know belong in a platform's
    ``register_custom_kv_cache_specs`` hook, which runs once per container.
    """
    if manager_class is None:
        raise ValueError("register_kv_cache_spec: manager_class is required")

    def decorator(kv_cache_spec_cls: SpecT) -> SpecT:
        KVCacheSpecRegistry.register(kv_cache_spec_cls, manager_class, uniform_type_base_spec)
        return kv_cache_spec_cls

    return decorator
