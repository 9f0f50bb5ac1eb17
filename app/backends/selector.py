"""Choosing the MLA prefill backend for a config on the active container's platform.

``get_mla_prefill_backend(config)``:

1. An explicit ``config.attention.mla_prefill_backend`` is validated against the platform's
   device capability; an invalid one raises ``ValueError("Selected MLA prefill backend X is not
   valid for this configuration. Reason: [...]")``.
2. Otherwise the platform's ``mla_prefill_backend_priorities(selector_config)`` is walked and
   the first valid class is returned; when none is valid, ``ValueError("No valid MLA prefill
   backend found with ... Reasons: {NAME: [...], ...}.")``.

A backend whose class does not import (``ImportError``), is not registered, or is not an
``MLAPrefillBackend`` subclass is invalid, with that as its reason.

The result is cached per container (in its ``RegistryState``) per config, platform and registry
state: a registration change made through ``app.backends.registry`` empties the cache, and a
cached entry is only used while the container's platform is the same object and every backend
provider the selection consulted has the same last overriding provider (so a direct
``provider.override(...)`` is seen too). A cached selection is a ``ContextVar`` read, an
attribute read, a dict lookup, a platform provider call and one identity check per consulted
provider.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from app._imports import object_path
from app.backends.base import MLAPrefillBackend, MLAPrefillSelectorConfig
from app.backends.registry import (
    STATE_ATTR,
    MLAPrefillBackendEnum,
    RegistryState,
    _CacheEntry,
    _provider_path,
    get_registry_state,
    resolve_backend_class,
)
from app.containers import get_container

if TYPE_CHECKING:
    from app._types import DeviceCapability
    from app.config import EngineConfig
    from app.containers import Application
    from app.platforms import Platform

__all__ = [
    "BackendVerdict",
    "SelectionExplanation",
    "explain_mla_prefill_selection",
    "get_mla_prefill_backend",
    "select_for_container",
]

logger = logging.getLogger(__name__)

#: Most configs remembered by identity per container (then that level starts afresh).
MAX_CACHED_CONFIGS = 1024

_Token = tuple[Any, Any]


def get_mla_prefill_backend(config: EngineConfig | None = None, *,
                            container: Application | None = None
                            ) -> type[MLAPrefillBackend]:
    """The MLA prefill backend class for ``config`` (default: the container's config) on the
    platform of ``container`` (default: the active container).

    Raises ``ValueError`` when an explicit backend is invalid here, or when no backend in the
    platform's priority list is valid.
    """
    if container is None:
        container = get_container()
    state: RegistryState | None = getattr(container, STATE_ATTR, None)
    if state is None or state.owner is not container:
        state = get_registry_state(container)
    if config is None:
        config = state.config_provider()
    entry = state.by_config.get(id(config))
    if (entry is not None and entry.config is config
            and entry.platform is state.platform_provider()):
        for provider, token in entry.tokens:
            if provider.last_overriding is not token:
                break
        else:
            return entry.cls
    return _select(state, config)


def select_for_container(container: Application) -> type[MLAPrefillBackend]:
    """The backend class for ``container``'s own config and platform (its
    ``mla_prefill_backend_class`` provider), whichever container is active."""
    return get_mla_prefill_backend(None, container=container)


def _tokens_valid(tokens: Sequence[_Token]) -> bool:
    return all(provider.last_overriding is token for provider, token in tokens)


def _select(state: RegistryState, config: EngineConfig) -> type[MLAPrefillBackend]:
    """The uncached path: look the selection up by value, else compute it; then cache it."""
    generation = state.generation
    platform: Platform = state.platform_provider()
    explicit = config.attention.mla_prefill_backend
    model = config.model
    key = (explicit, model.dtype, model.qk_nope_head_dim, model.qk_rope_head_dim,
           model.v_head_dim, id(platform))
    entry = state.by_key.get(key)
    if entry is None or entry.platform is not platform or not _tokens_valid(entry.tokens):
        entry = _compute(state, config, platform)
    with state.lock:
        if state.generation == generation:
            state.by_key[key] = entry
            if len(state.by_config) >= MAX_CACHED_CONFIGS:
                state.by_config.clear()
            state.by_config[id(config)] = _CacheEntry(config, platform, entry.cls, entry.name,
                                                      entry.tokens)
    return entry.cls


def _compute(state: RegistryState, config: EngineConfig, platform: Platform) -> _CacheEntry:
    selector_config = MLAPrefillSelectorConfig.from_engine_config(config)
    capability = platform.get_device_capability()
    explicit = config.attention.mla_prefill_backend
    tokens: list[_Token] = []
    chosen: type[MLAPrefillBackend] | None = None
    if explicit is not None:
        name = explicit.name
        cls, reasons, token = _check(state, name, capability, selector_config)
        if reasons or cls is None:
            raise ValueError(_explicit_error(name, reasons))
        chosen = cls
        if token is not None:
            tokens.append(token)
    else:
        all_reasons: dict[str, list[str]] = {}
        for name in _priority_names(platform, selector_config):
            cls, reasons, token = _check(state, name, capability, selector_config)
            if token is not None:
                tokens.append(token)
            if not reasons and cls is not None:
                chosen = cls
                break
            all_reasons[name] = reasons
        if chosen is None:
            message = _none_valid_error(selector_config, platform, all_reasons)
            logger.debug("%s", message)
            raise ValueError(message)
    with state.lock:
        state.selections += 1
    logger.info("Using %s MLA prefill backend (%s) on %r.", name, object_path(chosen), platform)
    return _CacheEntry(config, platform, chosen, name, tuple(tokens))


def _priority_names(platform: Platform, selector_config: MLAPrefillSelectorConfig) -> list[str]:
    names = []
    for item in platform.mla_prefill_backend_priorities(selector_config):
        names.append(item.name if isinstance(item, MLAPrefillBackendEnum) else str(item))
    return names


def _check(state: RegistryState, name: str, capability: DeviceCapability | None,
           selector_config: MLAPrefillSelectorConfig
           ) -> tuple[type[MLAPrefillBackend] | None, list[str], _Token | None]:
    """(class, reasons it is invalid, cache token) of backend ``name`` in ``state``'s
    container."""
    if name not in MLAPrefillBackendEnum.__members__:
        return None, [f"unknown MLA prefill backend {name!r}"], None
    provider = state.provider(name)
    token = None if provider is None else (provider, provider.last_overriding)
    try:
        cls = resolve_backend_class(name, provider)
    except ImportError as exc:
        return None, [f"ImportError: {exc}"], token
    except TypeError as exc:
        return None, [f"TypeError: {exc}"], token
    except ValueError as exc:  # not registered in this container
        return None, [str(exc)], token
    try:
        reasons = list(cls.validate_configuration(capability, selector_config))
    except ImportError as exc:
        reasons = [f"ImportError: {exc}"]
    return cls, reasons, token


def _explicit_error(name: str, reasons: list[str]) -> str:
    return (f"Selected MLA prefill backend {name} is not valid for this configuration. "
            f"Reason: {reasons}")


def _none_valid_error(selector_config: MLAPrefillSelectorConfig, platform: Platform,
                      all_reasons: dict[str, list[str]]) -> str:
    listed = ", ".join(f"{name}: [{', '.join(reasons)}]" for name, reasons in all_reasons.items())
    return (f"No valid MLA prefill backend found with {selector_config!r} on {platform!r}. "
            f"Reasons: {{{listed}}}.")


class BackendVerdict(TypedDict):
    """One backend in ``explain_mla_prefill_selection``."""

    name: str
    #: The class path the container resolves it to (None when unregistered).
    class_path: str | None
    overridden: bool
    #: Its index in the platform's priority list (None when not listed).
    priority: int | None
    valid: bool
    reasons: list[str]


class SelectionExplanation(TypedDict):
    """What ``explain_mla_prefill_selection`` returns (JSON-friendly)."""

    platform: str
    device_capability: str | None
    dtype: str
    mla_dimensions: dict[str, int]
    #: The explicitly configured backend, or None for automatic selection.
    requested: str | None
    priorities: list[str]
    #: Every backend (every enum member, then unknown names a platform listed), in order.
    backends: dict[str, BackendVerdict]
    #: The backend ``get_mla_prefill_backend`` picks (None when it raises).
    chosen: str | None
    chosen_class: str | None
    #: The ``ValueError`` message ``get_mla_prefill_backend`` raises, when it does.
    error: str | None


def explain_mla_prefill_selection(config: EngineConfig | None = None, *,
                                  container: Application | None = None
                                  ) -> SelectionExplanation:
    """Why each backend is or is not valid for ``config`` on ``container``'s platform
    (defaults as in ``get_mla_prefill_backend``), and which one is chosen. Never cached."""
    state = get_registry_state(container)
    if config is None:
        config = state.config_provider()
    platform: Platform = state.platform_provider()
    selector_config = MLAPrefillSelectorConfig.from_engine_config(config)
    capability = platform.get_device_capability()
    priorities = _priority_names(platform, selector_config)
    names = list(MLAPrefillBackendEnum.__members__)
    names += [n for n in dict.fromkeys(priorities) if n not in names]
    verdicts: dict[str, BackendVerdict] = {}
    classes: dict[str, type[MLAPrefillBackend] | None] = {}
    for name in names:
        cls, reasons, _ = _check(state, name, capability, selector_config)
        classes[name] = cls
        provider = state.provider(name)
        class_path: str | None = None
        if provider is not None:
            try:
                class_path = _provider_path(name, provider)
            except (ValueError, TypeError):
                class_path = None
        verdicts[name] = BackendVerdict(
            name=name, class_path=class_path,
            overridden=provider is not None and bool(provider.overridden),
            priority=priorities.index(name) if name in priorities else None,
            valid=not reasons and cls is not None, reasons=reasons)
    explicit = config.attention.mla_prefill_backend
    chosen: str | None = None
    error: str | None = None
    if explicit is not None:
        if verdicts[explicit.name]["valid"]:
            chosen = explicit.name
        else:
            error = _explicit_error(explicit.name, verdicts[explicit.name]["reasons"])
    else:
        chosen = next((n for n in priorities if verdicts[n]["valid"]), None)
        if chosen is None:
            error = _none_valid_error(selector_config, platform,
                                      {n: verdicts[n]["reasons"] for n in priorities})
    chosen_cls = None if chosen is None else classes[chosen]
    dims = selector_config.mla_dimensions
    return SelectionExplanation(
        platform=repr(platform),
        device_capability=None if capability is None else str(capability),
        dtype=str(selector_config.dtype).removeprefix("torch."),
        mla_dimensions={"qk_nope_head_dim": dims.qk_nope_head_dim,
                        "qk_rope_head_dim": dims.qk_rope_head_dim,
                        "v_head_dim": dims.v_head_dim},
        requested=None if explicit is None else explicit.name,
        priorities=priorities,
        backends=verdicts,
        chosen=chosen,
        chosen_class=None if chosen_cls is None else object_path(chosen_cls),
        error=error)
