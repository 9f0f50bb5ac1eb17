"""Choosing a backend of one kind for a config on a platform, written once for every kind.

``select_backend(kind, config, platform, backends, cache)``:

1. A backend the config forces (``config.attention.mla_prefill_backend`` /
   ``mla_decode_backend``) is validated against the platform's device capability; an invalid
   one raises ``ValueError("Selected MLA prefill backend X is not valid for this
   configuration. Reason: [...]")`` and an unknown name vLLM's ``Unknown ... backend``.
2. Otherwise the platform's priority list for the kind is walked and the first valid class is
   returned; when none is valid, ``ValueError("No valid MLA prefill backend found with ...
   Reasons: {NAME: [...], ...}.")``.

A backend whose class does not import (``ImportError``), is not registered, or is not a
concrete subclass of the kind's base is invalid, with that as its reason.

Everything is passed in: the container's providers call this with its config, platform and
backends; the facades in ``app.backends.selector`` do the same for the active container.
``SelectionCache`` (one per container, its ``selection_cache`` provider) remembers results
keyed by exactly what selection reads: the kind, the requested name, the selector config, the
platform object and every backend provider with the override in effect. A registration,
a direct ``provider.override(...)`` or another platform therefore never sees a stale entry.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, TypedDict

import attrs
import torch

from app._imports import object_path
from app.backends._providers import REGISTRATION_LOCK, class_path, provider_of, resolve_class
from app.backends.kinds import BackendKind

if TYPE_CHECKING:
    from app._types import DeviceCapability
    from app.config import EngineConfig
    from app.platforms.base import Platform

__all__ = [
    "BackendVerdict",
    "SelectionCache",
    "SelectionExplanation",
    "explain_selection",
    "select_backend",
]

logger = logging.getLogger(__name__)


class SelectionCache:
    """Selected classes keyed by what selection reads (bounded; thread-safe)."""

    #: Most entries kept (then the cache starts afresh).
    max_entries = 256

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], type[Any]] = {}
        self._lock = threading.Lock()
        #: Selections computed (cache misses), for diagnostics and benchmarks.
        self.misses = 0

    def get(self, key: tuple[Any, ...]) -> type[Any] | None:
        """The class remembered for ``key``, or None."""
        return self._entries.get(key)

    def put(self, key: tuple[Any, ...], cls: type[Any]) -> None:
        """Remember ``cls`` for ``key``."""
        with self._lock:
            self.misses += 1
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[key] = cls

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"SelectionCache(entries={len(self._entries)}, misses={self.misses})"


def _provider_state(backends: Any) -> tuple[Any, ...]:
    """Every backend provider with the override that is in effect (part of the cache key):
    the last overriding provider wins, so it alone decides what a provider gives. Read under
    the registration lock: a registration by a new name adds a provider meanwhile."""
    with REGISTRATION_LOCK:
        return tuple((provider, provider.last_overriding)
                     for provider in backends.providers.values())


def select_backend(kind: BackendKind, config: EngineConfig, platform: Platform, backends: Any,
                   cache: SelectionCache | None = None, **selection_args: Any) -> type[Any]:
    """The backend class of ``kind`` for ``config`` on ``platform`` among ``backends`` (the
    container's providers of that kind). ``selection_args``: the kind's extra selection inputs
    (decode: ``query_len``). Raises ``ValueError`` when nothing valid is found."""
    selector_config = kind.selector_config(config, **selection_args)
    requested = kind.requested(config)
    key = (kind.name, requested, selector_config, platform, _provider_state(backends))
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    capability = platform.get_device_capability()
    if requested is not None:
        name = kind.names.resolve(requested)
        chosen, reasons = check_backend(kind, backends, name, capability, selector_config)
        if reasons or chosen is None:
            raise ValueError(_explicit_error(kind, name, reasons))
    else:
        all_reasons: dict[str, list[str]] = {}
        chosen = None
        for name in kind.priorities(platform, selector_config):
            cls, reasons = check_backend(kind, backends, name, capability, selector_config)
            if not reasons and cls is not None:
                chosen = cls
                break
            all_reasons[name] = reasons
        if chosen is None:
            message = _none_valid_error(kind, selector_config, platform, all_reasons)
            logger.debug("%s", message)
            raise ValueError(message)
    logger.info("Using %s %s backend (%s) on %r.", name, kind.label, object_path(chosen),
                platform)
    if cache is not None:
        cache.put(key, chosen)
    return chosen


def check_backend(kind: BackendKind, backends: Any, name: str,
                  capability: DeviceCapability | None, selector_config: Any
                  ) -> tuple[type[Any] | None, list[str]]:
    """(class, reasons it is invalid) of backend ``name`` among ``backends``."""
    if name not in kind.names:
        return None, [f"unknown {kind.label} backend {name!r}"]
    try:
        cls = resolve_class(kind, name, provider_of(backends, name))
    except ImportError as exc:
        return None, [f"ImportError: {exc}"]
    except TypeError as exc:
        return None, [f"TypeError: {exc}"]
    except ValueError as exc:  # not registered in this container
        return None, [str(exc)]
    try:
        reasons = list(cls.validate_configuration(capability, selector_config))
    except ImportError as exc:
        reasons = [f"ImportError: {exc}"]
    return cls, reasons


def _explicit_error(kind: BackendKind, name: str, reasons: list[str]) -> str:
    return (f"Selected {kind.label} backend {name} is not valid for this configuration. "
            f"Reason: {reasons}")


def _none_valid_error(kind: BackendKind, selector_config: Any, platform: Platform,
                      all_reasons: dict[str, list[str]]) -> str:
    listed = ", ".join(f"{name}: [{', '.join(reasons)}]" for name, reasons in all_reasons.items())
    return (f"No valid {kind.label} backend found with {selector_config!r} on {platform!r}. "
            f"Reasons: {{{listed}}}.")


class BackendVerdict(TypedDict):
    """One backend in an explanation."""

    name: str
    #: The class path the container resolves it to (None when unregistered).
    class_path: str | None
    overridden: bool
    #: Its index in the platform's priority list (None when not listed).
    priority: int | None
    valid: bool
    reasons: list[str]


class SelectionExplanation(TypedDict, total=False):
    """What the ``explain_*_selection`` functions return (JSON-friendly)."""

    kind: str
    platform: str
    device_capability: str | None
    dtype: str
    #: Prefill only: the model's MLA dimensions.
    mla_dimensions: dict[str, int]
    #: Every field selection reads (dtype as a name).
    selector_config: dict[str, Any]
    #: The explicitly configured backend, or None for automatic selection.
    requested: str | None
    priorities: list[str]
    #: Every backend (every enum member, then unknown names a platform listed), in order.
    backends: dict[str, BackendVerdict]
    #: The backend selection picks (None when it raises).
    chosen: str | None
    chosen_class: str | None
    #: The ``ValueError`` message selection raises, when it does.
    error: str | None


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _verdict(kind: BackendKind, backends: Any, name: str, priorities: list[str],
             capability: DeviceCapability | None, selector_config: Any
             ) -> tuple[BackendVerdict, type[Any] | None]:
    cls, reasons = check_backend(kind, backends, name, capability, selector_config)
    provider = provider_of(backends, name)
    path: str | None = None
    if provider is not None:
        try:
            path = class_path(kind, name, provider)
        except (ValueError, TypeError):
            path = None
    return BackendVerdict(
        name=name, class_path=path,
        overridden=provider is not None and bool(provider.overridden),
        priority=priorities.index(name) if name in priorities else None,
        valid=not reasons and cls is not None, reasons=reasons), cls


def explain_selection(kind: BackendKind, config: EngineConfig, platform: Platform,
                      backends: Any, **selection_args: Any) -> SelectionExplanation:
    """Why each backend of ``kind`` is or is not valid, and which one is chosen (never
    cached)."""
    selector_config = kind.selector_config(config, **selection_args)
    capability = platform.get_device_capability()
    priorities = kind.priorities(platform, selector_config)
    names = list(kind.names)
    names += [n for n in dict.fromkeys(priorities) if n not in names]
    verdicts: dict[str, BackendVerdict] = {}
    classes: dict[str, type[Any] | None] = {}
    for name in names:
        verdicts[name], classes[name] = _verdict(kind, backends, name, priorities, capability,
                                                 selector_config)
    requested = kind.requested(config)
    chosen: str | None = None
    error: str | None = None
    if requested is not None:
        try:
            name = requested = kind.names.resolve(requested)
        except ValueError as exc:
            error = str(exc)
        else:
            if verdicts[name]["valid"]:
                chosen = name
            else:
                error = _explicit_error(kind, name, verdicts[name]["reasons"])
    else:
        chosen = next((n for n in priorities if verdicts[n]["valid"]), None)
        if chosen is None:
            error = _none_valid_error(kind, selector_config, platform,
                                      {n: verdicts[n]["reasons"] for n in priorities})
    chosen_cls = None if chosen is None else classes[chosen]
    fields = _plain(attrs.asdict(selector_config, recurse=True))
    explanation = SelectionExplanation(
        kind=kind.name, platform=repr(platform),
        device_capability=None if capability is None else str(capability),
        dtype=fields.get("dtype", ""), selector_config=fields,
        requested=requested, priorities=priorities, backends=verdicts, chosen=chosen,
        chosen_class=None if chosen_cls is None else object_path(chosen_cls), error=error)
    if "mla_dimensions" in fields:
        explanation["mla_dimensions"] = fields["mla_dimensions"]
    return explanation
