"""KV-cache spec bindings: spec type -> (manager class, uniform base spec), one object per
container, and the built-in bindings.

The container builds a ``KVCacheSpecBindings`` (provider ``kv_cache_spec_bindings``) with its
platform and config; on first use it registers the built-in specs (``BUILTIN_KV_CACHE_SPECS``),
then runs the platform hook ``Platform.register_custom_kv_cache_specs(bindings, config)`` once
(a hook that raises is rolled back: its registrations are dropped and the next use runs it
again).
Lookups walk the spec's MRO (an unregistered subclass inherits its parent's binding) and are
cached per type; any registration clears the cache. Inside ``rollback_on_error`` (a general
plugin runs in one) a registration is taken back when the block fails; the built-ins and the
platform hook, set up on first use, stay. Hot paths hold the bindings and call
``bindings.get_manager_class(spec)``: a dict lookup on ``type(spec)``.

Full, MLA, TQFull, HiddenState and SinkFull share the full-attention base (they can share a
KV-cache group); every other built-in is its own base. Adding a built-in spec kind is one spec
class, one manager (or an existing one) and one line in ``BUILTIN_KV_CACHE_SPECS``.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

import app.kvcache.managers as m
import app.kvcache.specs as s
from app._container_state import record_undo, undo_suspended
from app.kvcache.managers import SingleTypeKVCacheManager
from app.kvcache.specs import KVCacheSpec

if TYPE_CHECKING:
    from app.config import EngineConfig
    from app.platforms.base import Platform

__all__ = [
    "BUILTIN_KV_CACHE_SPECS",
    "REGISTER_HINT",
    "KVCacheSpecBindings",
    "KVCacheSpecEntry",
    "KVCacheSpecMetadata",
    "bindings_in_setup",
]

logger = logging.getLogger(__name__)

REGISTER_HINT = ("Register it with @register_kv_cache_spec(manager_class=...) or "
                  "KVCacheSpecRegistry.register(spec_cls, manager_class).")


#: The bindings whose platform hook is running (a hook written as vLLM's registers through the
#: seed API, which asks here first).
_bindings_in_setup: contextvars.ContextVar[KVCacheSpecBindings | None] = contextvars.ContextVar(
    "app_bindings_in_setup", default=None)


def bindings_in_setup() -> KVCacheSpecBindings | None:
    """The bindings whose platform hook is running in this thread / task, or None."""
    return _bindings_in_setup.get()


def _positional_parameters(function: Callable[..., Any]) -> int | None:
    """How many positional parameters ``function`` takes (None: any number, or unknown)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


#: ``(spec type, manager class, uniform base spec)``.
KVCacheSpecEntry = tuple[type[KVCacheSpec], type[SingleTypeKVCacheManager], type[KVCacheSpec]]

#: The built-in bindings.
BUILTIN_KV_CACHE_SPECS: tuple[KVCacheSpecEntry, ...] = (
    (s.FullAttentionSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.MLAAttentionSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.TQFullAttentionSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.HiddenStateCacheSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.SinkFullAttentionSpec, m.SinkFullAttentionManager, s.FullAttentionSpec),
    (s.SlidingWindowSpec, m.SlidingWindowManager, s.SlidingWindowSpec),
    (s.SlidingWindowMLASpec, m.SlidingWindowManager, s.SlidingWindowMLASpec),
    (s.ChunkedLocalAttentionSpec, m.ChunkedLocalAttentionManager, s.ChunkedLocalAttentionSpec),
    (s.CrossAttentionSpec, m.CrossAttentionManager, s.CrossAttentionSpec),
    (s.MambaSpec, m.MambaManager, s.MambaSpec),
)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@attrs.frozen
class KVCacheSpecMetadata:
    """What a spec type is bound to: its manager class and its uniform base spec.

    Layers whose specs share a uniform base spec can form one KV-cache group.
    """

    kv_cache_spec_cls: type[KVCacheSpec]
    manager_class: type[SingleTypeKVCacheManager]
    uniform_type_base_spec: type[KVCacheSpec]


class KVCacheSpecBindings:
    """One container's spec -> manager bindings (build one per container, or standalone).

    ``builtins`` (the container passes ``BUILTIN_KV_CACHE_SPECS``, also the default) are
    registered on first use. ``platform`` and ``config`` (values or zero-argument callables,
    read on first use) feed the platform hook: the container passes its
    ``platform`` and ``config`` providers. ``KVCacheSpecBindings()`` (no platform) is
    standalone: built-ins only, no hook.
    """

    def __init__(self, *,
                 platform: Platform | Callable[[], Platform] | None = None,
                 config: EngineConfig | Callable[[], EngineConfig | None] | None = None,
                 builtins: Iterable[KVCacheSpecEntry] = BUILTIN_KV_CACHE_SPECS) -> None:
        self._builtins = tuple(builtins)
        self._lock = threading.RLock()
        self._entries: dict[type[KVCacheSpec], KVCacheSpecMetadata] = {}
        self._manager_cache: dict[type, type[SingleTypeKVCacheManager] | None] = {}
        self._base_cache: dict[type, type[KVCacheSpec] | None] = {}
        self._platform = platform
        self._config = config
        self._builtins_registered = False
        self._hook_ran = False
        self._initializing = False
        #: Built-ins registered and the platform hook run (or explicitly none): lookups cache.
        self._ready = False
        #: Counts registrations; a lookup computed under an older generation is not cached.
        self._generation = 0

    # -- setup -------------------------------------------------------------------------------

    @property
    def manager_classes_by_type(self) -> Mapping[type, type[SingleTypeKVCacheManager] | None]:
        """The answers ``get_manager_class`` has kept, by spec type (read-only; the same dict
        for the life of the bindings: a registration empties it in place). The seed API reads
        it directly to answer a repeated lookup without a call."""
        return self._manager_cache

    @property
    def hook_ran(self) -> bool:
        """Whether the platform hook has run on these bindings."""
        return self._hook_ran

    def ensure_ready(self) -> None:
        """Register the built-ins, then run the platform hook once (idempotent, re-entrant).

        The platform and config given at construction are read here, on first use. When the
        hook raises, its error propagates, what it registered is dropped and it is not marked
        as run: the next call runs it again.
        """
        if self._ready:
            return
        with self._lock:
            if self._ready or self._initializing:
                return
            self._initializing = True
            try:
                with undo_suspended():
                    self._set_up()
                self._ready = True
            finally:
                self._initializing = False

    def _set_up(self) -> None:
        """The built-ins, then the platform hook, each once (``ensure_ready`` holds the lock)."""
        if not self._builtins_registered:
            self._builtins_registered = True
            for spec, manager, base in self._builtins:
                self.register(spec, manager, base)
        if not self._hook_ran:
            platform, config = self._resolve_platform()
            if platform is not None:
                self._run_hook_or_roll_back(platform, config)

    def _run_hook_or_roll_back(self, platform: Platform, config: EngineConfig | None) -> None:
        """Run the platform hook once; a hook that raises leaves the bindings as they were
        before it ran (what it registered is dropped) and not marked as run, so the next use
        runs it again. Called holding the lock."""
        before = dict(self._entries)
        self._hook_ran = True
        try:
            self._run_platform_hook(platform, config)
        except BaseException:
            self._hook_ran = False
            self._entries.clear()
            self._entries.update(before)
            self._changed()
            raise

    def _run_platform_hook(self, platform: Platform, config: EngineConfig | None) -> None:
        """``platform.register_custom_kv_cache_specs(self, config)``; a hook written as vLLM's
        (``register_custom_kv_cache_specs(cls, vllm_config)``, registering through
        ``KVCacheSpecRegistry``) is called with the config alone while these bindings are the
        ones being set up, so its registrations land here."""
        hook = platform.register_custom_kv_cache_specs
        logger.debug("running %r.register_custom_kv_cache_specs", platform)
        if _positional_parameters(hook) == 1:
            token = _bindings_in_setup.set(self)
            try:
                hook(config)  # type: ignore[call-arg]
            finally:
                _bindings_in_setup.reset(token)
        else:
            hook(self, config)

    def _resolve_platform(self) -> tuple[Platform | None, EngineConfig | None]:
        platform_src, config_src = self._platform, self._config
        platform = platform_src() if callable(platform_src) else platform_src
        config = config_src() if callable(config_src) else config_src
        return platform, config

    # -- registration --------------------------------------------------------------------

    def register(self, kv_cache_spec_cls: type[KVCacheSpec],
                 manager_class: type[SingleTypeKVCacheManager] | None = None,
                 uniform_type_base_spec: type[KVCacheSpec] | None = None) -> None:
        """Bind ``kv_cache_spec_cls`` to ``manager_class`` and its uniform base spec.

        The base defaults to the spec itself and must be a superclass of it. Registering the
        same binding again is a no-op; a different manager or base is a conflict. Missing
        manager, wrong base and conflicts raise ``ValueError``; non-classes ``TypeError``.
        """
        if not isinstance(kv_cache_spec_cls, type) or not issubclass(kv_cache_spec_cls,
                                                                      KVCacheSpec):
            raise TypeError(f"register: expected a KVCacheSpec subclass, "
                            f"got {kv_cache_spec_cls!r}")
        spec_name = kv_cache_spec_cls.__name__
        if manager_class is None:
            raise ValueError(f"register: manager_class is required for KV cache spec "
                             f"{spec_name}")
        if not isinstance(manager_class, type) or not issubclass(manager_class,
                                                                 SingleTypeKVCacheManager):
            raise TypeError(f"register: manager_class for {spec_name} must be a "
                            f"SingleTypeKVCacheManager subclass, got {manager_class!r}")
        if uniform_type_base_spec is None:
            uniform_type_base_spec = kv_cache_spec_cls
        if not isinstance(uniform_type_base_spec, type) or not issubclass(
                kv_cache_spec_cls, uniform_type_base_spec):
            raise ValueError(f"register: {spec_name} must inherit from its declared "
                             f"uniform_type_base_spec {uniform_type_base_spec!r}")
        self.ensure_ready()
        with self._lock:
            current = self._entries.get(kv_cache_spec_cls)
            if current is not None:
                if (current.manager_class is manager_class
                        and current.uniform_type_base_spec is uniform_type_base_spec):
                    return
                raise ValueError(
                    f"Conflicting registration for KV cache spec {spec_name}: it is bound to "
                    f"manager {current.manager_class.__name__} with uniform base "
                    f"{current.uniform_type_base_spec.__name__}, not manager "
                    f"{manager_class.__name__} with uniform base "
                    f"{uniform_type_base_spec.__name__}")
            entry = KVCacheSpecMetadata(
                kv_cache_spec_cls=kv_cache_spec_cls, manager_class=manager_class,
                uniform_type_base_spec=uniform_type_base_spec)
            self._entries[kv_cache_spec_cls] = entry
            self._changed()
        record_undo(lambda: self._unbind(entry))

    def _unbind(self, entry: KVCacheSpecMetadata) -> None:
        """Take back the registration that bound ``entry`` (a failed plugin's, see the
        module), unless something else replaced it since."""
        with self._lock:
            if self._entries.get(entry.kv_cache_spec_cls) is entry:
                del self._entries[entry.kv_cache_spec_cls]
                self._changed()

    def _changed(self) -> None:
        """After a change to the entries: a new generation, and no lookup kept."""
        self._generation += 1
        self._manager_cache.clear()
        self._base_cache.clear()

    # -- lookups -------------------------------------------------------------------------

    def get_metadata(self, kv_cache_spec: KVCacheSpec | type[KVCacheSpec]
                     ) -> KVCacheSpecMetadata | None:
        """The binding that applies to a spec (or spec type): the first registered type in
        its MRO, or None."""
        self.ensure_ready()
        cls = kv_cache_spec if isinstance(kv_cache_spec, type) else type(kv_cache_spec)
        entries = self._entries
        for base in cls.__mro__:
            meta = entries.get(base)
            if meta is not None:
                return meta
        return None

    def get_manager_class(self, kv_cache_spec: KVCacheSpec
                          ) -> type[SingleTypeKVCacheManager] | None:
        """The manager class for ``kv_cache_spec`` (MRO walk, cached per type), or None."""
        try:
            return self._manager_cache[type(kv_cache_spec)]
        except KeyError:
            manager: type[SingleTypeKVCacheManager] | None = self._lookup(
                kv_cache_spec, self._manager_cache, "manager_class")
            return manager

    def get_uniform_type_base_spec(self, kv_cache_spec: KVCacheSpec
                                   ) -> type[KVCacheSpec] | None:
        """The uniform base spec for ``kv_cache_spec`` (MRO walk, cached per type), or None."""
        try:
            return self._base_cache[type(kv_cache_spec)]
        except KeyError:
            base: type[KVCacheSpec] | None = self._lookup(
                kv_cache_spec, self._base_cache, "uniform_type_base_spec")
            return base

    def _lookup(self, spec: Any, cache: dict[type, Any], field: str) -> Any:
        if isinstance(spec, type):  # a class rather than an instance: answer, do not cache
            meta = self.get_metadata(spec)
            return None if meta is None else getattr(meta, field)
        self.ensure_ready()
        with self._lock:
            generation = self._generation
            meta = self.get_metadata(spec)
            value = None if meta is None else getattr(meta, field)
            if self._ready and generation == self._generation:
                cache[type(spec)] = value
            return value

    def check_kv_cache_spec_registry(self, kv_cache_specs: Mapping[str, KVCacheSpec]) -> None:
        """``ValueError`` naming every layer whose spec type has no binding."""
        problems = []
        for layer_name, spec in kv_cache_specs.items():
            if self.get_metadata(spec) is None:
                problems.append(f"Unsupported KV cache spec type for layer {layer_name}: "
                                f"{_name(type(spec))}.")
        if problems:
            raise ValueError("\n".join([*problems, REGISTER_HINT]))

    def registered_specs(self) -> dict[type[KVCacheSpec], KVCacheSpecMetadata]:
        """A copy of the registered bindings (spec type -> metadata), in registration order."""
        self.ensure_ready()
        with self._lock:
            return dict(self._entries)

    def __contains__(self, kv_cache_spec_cls: object) -> bool:
        self.ensure_ready()
        return kv_cache_spec_cls in self._entries

    def __repr__(self) -> str:
        return f"KVCacheSpecBindings({len(self._entries)} specs, hook_ran={self._hook_ran})"
