"""vLLM's documented KV-cache spec API (the seeds) over the *active* container:
``KVCacheSpecRegistry`` (vLLM's classmethods), ``register_kv_cache_spec``, and the bindings that
``KVCacheSpec.is_uniform_with_collection(specs)`` uses when it is given none. Re-exported by
``app.kvcache`` and ``app.seed_api``.

Each call asks which container is active (``app._container_state.active_container()``) and
calls its ``kv_cache_spec_bindings`` provider; services inside the library get their bindings
passed in and never come here. This module and ``app.backends.seed_api`` are the only ones
below the composition root that ask for the active container. The last answer of
``get_manager_class`` is kept for the active container and dropped on every provider change
(``app._container_state.CHANGES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from app._container_state import ACTIVE_CONTAINER, CHANGES, active_container
from app.kvcache.bindings import KVCacheSpecBindings, KVCacheSpecMetadata, bindings_in_setup
from app.kvcache.managers import SingleTypeKVCacheManager
from app.kvcache.specs import KVCacheSpec, set_default_uniformity_lookup

__all__ = ["KVCacheSpecRegistry", "register_kv_cache_spec"]

SpecT = TypeVar("SpecT", bound=type[KVCacheSpec])

#: The active container as ``use_container`` set it (None: the process default); the kept
#: answer below is keyed by it.
_active_key = ACTIVE_CONTAINER.get
_NOTHING = object()

#: ``(container key, the bindings' manager classes by spec type)``; dropped on every provider
#: change (``_forget``).
_NO_BINDINGS: tuple[Any, Mapping[type, Any]] = (_NOTHING, {})
_last_bindings = _NO_BINDINGS


def _keep(kept: tuple[Any, Mapping[type, Any]]) -> None:
    """Keep the bindings' table (called by ``CHANGES.keep_if_unchanged``, under its lock)."""
    global _last_bindings
    _last_bindings = kept


def _forget() -> None:
    """Drop the kept table (on every provider change, under the counter's lock)."""
    global _last_bindings
    _last_bindings = _NO_BINDINGS


CHANGES.on_change(_forget)


def _active_bindings() -> KVCacheSpecBindings:
    """The active container's bindings (its ``kv_cache_spec_bindings`` provider, called); while
    a platform hook written as vLLM's runs, the bindings it is setting up."""
    in_setup = bindings_in_setup()
    if in_setup is not None:
        return in_setup
    bindings = active_container().kv_cache_spec_bindings()
    if not isinstance(bindings, KVCacheSpecBindings):
        raise TypeError("the container's kv_cache_spec_bindings provider must provide "
                        f"KVCacheSpecBindings, got {bindings!r}")
    return bindings


def _manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager] | None:
    """``get_manager_class`` the long way, keeping the bindings' table for the next call."""
    key, changes = _active_key(), CHANGES.count
    bindings = _active_bindings()
    found = bindings.get_manager_class(kv_cache_spec)
    if bindings_in_setup() is None:
        table = bindings.manager_classes_by_type
        CHANGES.keep_if_unchanged(changes, lambda: _keep((key, table)))
    return found


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
        last = _last_bindings
        if last[0] is _active_key():
            try:
                found: type[SingleTypeKVCacheManager] | None = last[1][type(kv_cache_spec)]
                return found
            except KeyError:
                pass
        return _manager_class(kv_cache_spec)

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


# ``spec.is_uniform_with_collection(specs)`` with no bindings (vLLM's signature) outside a
# grouping asks the active container's.
set_default_uniformity_lookup(KVCacheSpecRegistry.bindings)
