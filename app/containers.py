"""The composition root: the dependency-injection containers and the active container.

Data flows one way: config -> container -> (platform, backend classes, spec bindings,
workspaces) -> selector -> backend instance -> executor. This is the one module that wires
concrete classes: the backend providers come from the kinds' catalogs
(``app.catalog``), and every service gets what it needs passed in by a provider (the
spec bindings their platform and config, the selection its config, platform, backends and
cache, a backend its device capability and workspaces). No state is kept on a container
instance: it lives in providers, so overriding any provider at any time takes effect.

A process has one default container (``get_container()``); ``use_container(c)`` makes another
one active for a ``with`` block, per thread and per asyncio task (a ``ContextVar``). Both are
held in the leaf ``app._container_state`` (so the seed API's modules can ask for the active
container from below this module); this module installs the factory that builds the default. A
deployment is config plus overrides on a fresh container (``create_container``), never a
subclass of ``Application``: dependents of a subclassed provider are not rewired.

Every provider is one of ``app._container_state``' counted types, so any override or reset of one is
counted and the seed API's kept answers (``app.seed_api``) are dropped on the next call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dependency_injector import containers, providers

from app._container_state import (
    CountedCallable,
    CountedContainer,
    CountedFactory,
    CountedObject,
    CountedSingleton,
    activate,
    active_container,
    install_default_factory,
    reset_default,
    set_default,
)
from app._container_state import check_container as _check_container
from app._imports import import_object
from app.backends.registry import DECODE, PREFILL
from app.backends.selection import SelectionCache, select_backend
from app.backends.sparse.cpu_indexer import default_sparse_indexer
from app.backends.workspaces import KernelWorkspaces
from app.catalog import CUSTOM, DECODE_BACKENDS, PREFILL_BACKENDS, BackendCatalog
from app.config import EngineConfig
from app.kvcache.bindings import BUILTIN_KV_CACHE_SPECS, KVCacheSpecBindings
from app.platforms.base import Platform
from app.platforms.detect import detect_platform
from app.platforms.plugins import apply_general_plugins

__all__ = [
    "Application",
    "MLADecodeBackendClasses",
    "MLAPrefillBackendClasses",
    "build_backend",
    "build_decode_backend",
    "check_container",
    "create_container",
    "get_container",
    "reset_default_container",
    "set_default_container",
    "use_container",
]

logger = logging.getLogger(__name__)

def _backend_classes(catalog: BackendCatalog, class_name: str, attribute: str
                     ) -> type[containers.DeclarativeContainer]:
    """A container class with one provider per built-in of ``catalog`` (calling it imports and
    returns the class) and a ``CUSTOM`` provider that gives None until something is
    registered."""
    attributes: dict[str, Any] = {
        name: CountedCallable(import_object, path) for name, path in catalog.builtins.items()}
    attributes[CUSTOM] = CountedObject(None)
    attributes["__doc__"] = (
        f"One provider per {catalog.label} backend; calling one returns the backend *class*. "
        f"Override one to replace that backend in this container only: "
        f"``c.{attribute}.NAME.override(providers.Object(MyBackend))``.")
    attributes["__module__"] = __name__
    cls: type[containers.DeclarativeContainer] = type(
        class_name, (containers.DeclarativeContainer,), attributes)
    return cls


MLAPrefillBackendClasses = _backend_classes(PREFILL_BACKENDS, "MLAPrefillBackendClasses",
                                            "mla_prefill_backends")
MLADecodeBackendClasses = _backend_classes(DECODE_BACKENDS, "MLADecodeBackendClasses",
                                           "mla_decode_backends")


def build_backend(cls: type[Any], config: EngineConfig, platform: Platform,
                  workspaces: KernelWorkspaces) -> Any:
    """An instance of backend class ``cls`` (prefill or decode) for ``config``'s model, built
    with the platform's device capability and the container's kernel workspaces."""
    return cls.from_config(config, device_capability=platform.get_device_capability(),
                           workspaces=workspaces)


def build_decode_backend(select: Callable[..., type[Any]], config: EngineConfig,
                         platform: Platform, workspaces: KernelWorkspaces, *,
                         query_len: int = 1) -> Any:
    """An instance of the decode backend ``select(query_len=query_len)`` picks (the
    container's ``mla_decode_backend_class`` provider), built as ``build_backend`` does."""
    return build_backend(select(query_len=query_len), config, platform, workspaces)


class Application(containers.DeclarativeContainer):
    """The application container.

    Providers (each can be overridden at any time, and the override takes effect at once):
      - ``config``: the ``EngineConfig`` (override with ``providers.Object(cfg)``).
      - ``platform``: the ``Platform`` singleton (detected; override to pretend to be any GPU).
      - ``mla_prefill_backends`` / ``mla_decode_backends``: one provider per backend class.
      - ``selection_cache``: this container's ``SelectionCache``.
      - ``kernel_workspaces``: this container's kernel workspaces (one buffer per kernel and
        device, shared by every backend the container builds).
      - ``kv_cache_spec_bindings``: the KV-cache spec -> manager bindings, given the platform
        and config (read on first use).
      - ``mla_prefill_backend_class`` / ``mla_decode_backend_class``: the selected class for
        ``config`` on ``platform`` (decode: ``mla_decode_backend_class(query_len=N)``, 1 by
        default).
      - ``mla_prefill_backend`` / ``mla_decode_backend``: a new instance of the selected
        class, built with the platform's device capability and the workspaces (decode:
        ``mla_decode_backend(query_len=N)`` selects for that query length).
      - ``sparse_indexer``: a new DeepSeek Sparse Attention indexer (scores and top-k over
        the paged key cache), for a sparse model's engine: ``CpuSparseIndexer`` (the native
        kernels) on the CPU platform where they run, else ``TorchSparseIndexer``
        (``default_sparse_indexer``).
      - ``applied_general_plugins``: which general plugins ran on this container.
    """

    config = CountedObject(EngineConfig())
    platform = CountedSingleton(detect_platform)
    mla_prefill_backends = CountedContainer(MLAPrefillBackendClasses)
    mla_decode_backends = CountedContainer(MLADecodeBackendClasses)
    selection_cache = CountedSingleton(SelectionCache)
    kernel_workspaces = CountedSingleton(KernelWorkspaces)
    kv_cache_spec_bindings = CountedSingleton(
        KVCacheSpecBindings, platform=platform.provider, config=config.provider,
        builtins=providers.Object(BUILTIN_KV_CACHE_SPECS))
    mla_prefill_backend_class = CountedCallable(
        select_backend, providers.Object(PREFILL), config, platform, mla_prefill_backends,
        selection_cache)
    mla_decode_backend_class = CountedCallable(
        select_backend, providers.Object(DECODE), config, platform, mla_decode_backends,
        selection_cache)
    mla_prefill_backend = CountedFactory(
        build_backend, mla_prefill_backend_class, config, platform, kernel_workspaces)
    mla_decode_backend = CountedFactory(
        build_decode_backend, mla_decode_backend_class.provider, config, platform,
        kernel_workspaces)
    sparse_indexer = CountedFactory(default_sparse_indexer, platform)
    applied_general_plugins: CountedSingleton[dict[str, bool]] = CountedSingleton(dict)


def create_container(config: EngineConfig | Mapping[str, Any] | None = None,
                     platform: Platform | None = None, *, plugins: bool = True) -> Application:
    """A fresh container for ``config`` (an ``EngineConfig`` or its dict form) and ``platform``.

    With ``plugins`` (the default) every general plugin (``app.plugins``) runs once on it.
    Nothing global changes: activate it with ``use_container`` or pass it around.
    """
    if config is None:
        config = EngineConfig()
    elif isinstance(config, Mapping):
        config = EngineConfig.from_dict(config)
    elif not isinstance(config, EngineConfig):
        raise TypeError(f"create_container: config must be an EngineConfig, a dict or None, "
                        f"got {type(config).__name__}")
    if platform is not None and not isinstance(platform, Platform):
        raise TypeError(f"create_container: platform must be a Platform or None, "
                        f"got {type(platform).__name__}")
    container = Application()
    container.config.override(providers.Object(config))
    if platform is not None:
        container.platform.override(providers.Object(platform))
    if plugins:
        apply_general_plugins(container)
    return container


def check_container(container: object, where: str) -> Application:
    """``container`` if it is an ``Application`` container; ``TypeError`` naming ``where``
    (the caller), what is expected and what was given otherwise."""
    checked: Application = _check_container(container, where)
    return checked


def get_container() -> Application:
    """The active container: the innermost ``use_container``, else the process default."""
    current: Application = active_container()
    return current


def set_default_container(container: Application) -> None:
    """Replace the process-default container (an engine calls this once at start-up)."""
    set_default(check_container(container, "set_default_container"))


def reset_default_container() -> None:
    """Drop the process-default container; the next ``get_container()`` builds a fresh one."""
    reset_default()


# The process default is built on first use, by this module's factory.
install_default_factory(create_container)


@contextlib.contextmanager
def use_container(container: Application) -> Iterator[Application]:
    """Make ``container`` the active one inside the ``with`` block (this thread / task only)."""
    checked = check_container(container, "use_container")
    with activate(checked):
        yield checked
