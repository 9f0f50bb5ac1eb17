"""The composition root: the dependency-injection containers and the active container.

Data flows one way: config -> container -> (platform, backend classes, spec bindings) ->
selector -> backend instance -> executor. This module imports only the config and the
platforms; everything else it provides is named by dotted path and imported on first use, so
the facades (``MLAPrefillBackendEnum``, ``KVCacheSpecRegistry``) can import this module without
a cycle.

A process has one default container (``get_container()``); ``use_container(c)`` makes another
one active for a ``with`` block, per thread and per asyncio task (a ``ContextVar``). A deployment
is config plus overrides on a fresh container (``create_container``), never a subclass of
``Application``: dependents of a subclassed provider are not rewired.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from dependency_injector import containers, providers

from app._imports import import_object
from app.config import EngineConfig
from app.platforms import Platform, detect_platform
from app.plugins import apply_general_plugins

__all__ = [
    "BUILTIN_MLA_PREFILL_BACKENDS",
    "Application",
    "MLAPrefillBackendClasses",
    "create_container",
    "get_container",
    "reset_default_container",
    "set_default_container",
    "use_container",
]

#: Built-in backend names and the classes their providers import by default.
BUILTIN_MLA_PREFILL_BACKENDS: dict[str, str] = {
    "TORCH_SDPA": "app.backends.torch_sdpa.TorchSDPABackend",
    "FLASH_ATTN": "app.backends.flash_attn.FlashAttnBackend",
    "FLASHINFER": "app.backends.flashinfer.FlashInferBackend",
    "TRTLLM_RAGGED": "app.backends.trtllm_ragged.TrtllmRaggedBackend",
    "TOKENSPEED_MLA": "app.backends.tokenspeed_mla.TokenSpeedMLABackend",
}


_imported: dict[str, Any] = {}


def _call_by_path(path: str, *args: Any, **kwargs: Any) -> Any:
    """Import ``path`` when a provider first needs it (then keep it), and call it."""
    target = _imported.get(path)
    if target is None:
        target = _imported[path] = import_object(path)
    return target(*args, **kwargs)


class MLAPrefillBackendClasses(containers.DeclarativeContainer):
    """One provider per MLA prefill backend; calling one returns the backend *class*.

    Override one to replace that backend: ``c.mla_prefill_backends.FLASHINFER.override(
    providers.Object(MyBackend))``. ``CUSTOM`` provides None until something is registered.
    """

    TORCH_SDPA = providers.Callable(import_object, BUILTIN_MLA_PREFILL_BACKENDS["TORCH_SDPA"])
    FLASH_ATTN = providers.Callable(import_object, BUILTIN_MLA_PREFILL_BACKENDS["FLASH_ATTN"])
    FLASHINFER = providers.Callable(import_object, BUILTIN_MLA_PREFILL_BACKENDS["FLASHINFER"])
    TRTLLM_RAGGED = providers.Callable(import_object,
                                       BUILTIN_MLA_PREFILL_BACKENDS["TRTLLM_RAGGED"])
    TOKENSPEED_MLA = providers.Callable(import_object,
                                        BUILTIN_MLA_PREFILL_BACKENDS["TOKENSPEED_MLA"])
    CUSTOM: providers.Object[None] = providers.Object(None)


class Application(containers.DeclarativeContainer):
    """The application container: config, platform, backend classes, spec bindings, selection.

    Providers:
      - ``config``: the ``EngineConfig`` (override with ``providers.Object(cfg)``).
      - ``platform``: the ``Platform`` singleton (detected; override to pretend to be any GPU).
      - ``mla_prefill_backends``: one provider per backend class (``MLAPrefillBackendClasses``).
      - ``registry_lock``: this container's lock for registration and selection bookkeeping.
      - ``applied_general_plugins``: which general plugins ran on this container.
      - ``registry_state``: the mutable per-container registry bookkeeping (override
        generation, selection cache).
      - ``kv_cache_spec_bindings``: this container's KV-cache spec -> manager bindings.
      - ``mla_prefill_backend_class``: the selected backend class for ``config`` on ``platform``.
    """

    __self__ = providers.Self()

    config = providers.Object(EngineConfig())
    platform = providers.Singleton(detect_platform)
    mla_prefill_backends = providers.Container(MLAPrefillBackendClasses)
    registry_lock = providers.Singleton(threading.RLock)
    applied_general_plugins: providers.Singleton[dict[str, bool]] = providers.Singleton(dict)
    registry_state = providers.Singleton(_call_by_path, "app.backends.registry.RegistryState")
    kv_cache_spec_bindings = providers.Singleton(
        _call_by_path, "app.kvcache.registry.KVCacheSpecBindings")
    mla_prefill_backend_class = providers.Callable(
        _call_by_path, "app.backends.selector.select_for_container", __self__)


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


_default_lock = threading.Lock()
_default_container: Application | None = None
_active_container: contextvars.ContextVar[Application | None] = contextvars.ContextVar(
    "app_active_container", default=None)


def _check_container(container: object, where: str) -> Application:
    if not (containers.is_container(container)
            and isinstance(getattr(container, "mla_prefill_backends", None),
                           providers.Container)):
        raise TypeError(f"{where}: expected an app.containers.Application instance, "
                        f"got {container!r}")
    return container  # type: ignore[return-value]


def get_container() -> Application:
    """The active container: the innermost ``use_container``, else the process default."""
    active = _active_container.get()
    if active is not None:
        return active
    global _default_container
    if _default_container is None:
        with _default_lock:
            if _default_container is None:
                _default_container = create_container()
    return _default_container


def set_default_container(container: Application) -> None:
    """Replace the process-default container (an engine calls this once at start-up)."""
    global _default_container
    checked = _check_container(container, "set_default_container")
    with _default_lock:
        _default_container = checked


def reset_default_container() -> None:
    """Drop the process-default container; the next ``get_container()`` builds a fresh one."""
    global _default_container
    with _default_lock:
        _default_container = None


@contextlib.contextmanager
def use_container(container: Application) -> Iterator[Application]:
    """Make ``container`` the active one inside the ``with`` block (this thread / task only)."""
    checked = _check_container(container, "use_container")
    token = _active_container.set(checked)
    try:
        yield checked
    finally:
        _active_container.reset(token)
