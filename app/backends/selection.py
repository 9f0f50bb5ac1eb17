"""Choosing a backend of one kind for a config on a platform, written once for every kind.

One decision, ``decide``, serves both ``select_backend`` (the class, cached) and
``explain_selection`` (every backend's verdict, never cached):

1. A backend the config forces (``config.attention.mla_prefill_backend`` /
   ``mla_decode_backend``) is validated against the platform's device capability; an invalid
   one is ``ValueError("Selected MLA prefill backend X is not valid for this configuration.
   Reason: [...]")`` and an unknown name vLLM's ``Unknown ... backend``.
2. Otherwise the platform's priority list for the kind is walked and the first valid class is
   chosen; when none is valid, ``ValueError("No valid MLA prefill backend found with ...
   Reasons: {NAME: [...], ...}.")``.

A backend whose class does not import (``ImportError``), is not registered, or is not a
concrete subclass of the kind's base with well-typed declarations is invalid, with that as its
reason; so is one whose ``validate_configuration`` raises (the exception is the reason).

Everything is passed in (config, platform, the container's backend providers of the kind); the
container's providers and the seed API (``app.backends.seed_api``) call these with a
container's.
``SelectionCache`` (one per container) keeps results keyed by the kind, the forced name, the
selector config, the platform and the count of provider changes
(``app._container_state.CHANGES``), so a registration, a direct ``provider.override(...)`` or
another platform is never answered from a stale entry.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import attrs
import torch

from app._container_state import CHANGES
from app._imports import object_path
from app._validation import is_int
from app.backends.decode.base import MLADecodeBackend
from app.backends.registry import (
    BackendKind,
    class_path,
    declaration_failure,
    provider_of,
    resolve_class,
)

if TYPE_CHECKING:
    from app._types import DeviceCapability
    from app.config import EngineConfig
    from app.platforms.base import Platform

__all__ = [
    "BackendVerdict",
    "Decision",
    "SelectionCache",
    "SelectionExplanation",
    "check_backend",
    "check_decode_block_size",
    "decide",
    "explain_selection",
    "select_backend",
]

logger = logging.getLogger(__name__)

#: ``name -> (class or None, reasons it is invalid)``.
Checker = Callable[[str], "tuple[type[Any] | None, list[str]]"]


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


def check_backend(kind: BackendKind, backends: Any, name: str,
                  capability: DeviceCapability | None, selector_config: Any
                  ) -> tuple[type[Any] | None, list[str]]:
    """(class, reasons it is invalid) of backend ``name`` among ``backends``."""
    provider = provider_of(backends, name)
    if provider is None and name not in kind.catalog:
        return None, [f"unknown {kind.label} backend {name!r}"]
    try:
        cls = resolve_class(kind, name, provider)
    except ValueError as exc:  # not registered in this container
        return None, [str(exc)]
    except Exception as exc:  # ImportError, TypeError, or a provider of a third party's
        return None, [_failure(exc)]
    try:
        reasons = list(cls.validate_configuration(capability, selector_config))
    except Exception as exc:  # a third party's validate_configuration: a reason, not a crash
        # a class whose declarations changed since they were checked: say which
        try:
            bad = declaration_failure(cls, f"{kind.label} backend {name}")
        except Exception:  # its own declaration_problems fails: the first failure it is
            bad = None
        reasons = [_failure(bad if bad is not None else exc)]
    return cls, reasons


def _failure(exc: Exception) -> str:
    """An exception as a reason: ``"ImportError: no module named ..."`` (on one line)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class Decision(NamedTuple):
    """What ``decide`` concludes: the chosen backend, or the error selection raises."""

    name: str | None
    cls: type[Any] | None
    error: str | None
    #: The forced name as the catalog resolves it (None: automatic selection).
    requested: str | None


def decide(kind: BackendKind, requested: str | None, priorities: list[str], check: Checker,
           describe: Callable[[], str]) -> Decision:
    """The one decision: ``requested`` (a forced name) if it is valid, else the first valid
    name in ``priorities``. ``check(name)`` gives a backend's class and reasons (asked lazily,
    in order); ``describe()`` names the selector config and platform for the error."""
    if requested is not None:
        try:
            name = kind.catalog.resolve(requested)
        except ValueError as exc:
            return Decision(None, None, str(exc), requested)
        cls, reasons = check(name)
        if reasons or cls is None:
            return Decision(None, None, f"Selected {kind.label} backend {name} is not valid "
                                        f"for this configuration. Reason: {reasons}", name)
        return Decision(name, cls, None, name)
    all_reasons: dict[str, list[str]] = {}
    for name in priorities:
        cls, reasons = check(name)
        if not reasons and cls is not None:
            return Decision(name, cls, None, None)
        all_reasons[name] = reasons
    listed = ", ".join(f"{n}: [{', '.join(r)}]" for n, r in all_reasons.items())
    return Decision(None, None, f"No valid {kind.label} backend found with {describe()}. "
                                f"Reasons: {{{listed}}}.", None)


def select_backend(kind: BackendKind, config: EngineConfig, platform: Platform, backends: Any,
                   cache: SelectionCache | None = None, **selection_args: Any) -> type[Any]:
    """The backend class of ``kind`` for ``config`` on ``platform`` among ``backends`` (the
    container's providers of that kind). ``selection_args``: the kind's extra selection inputs
    (decode: ``query_len``). Raises ``ValueError`` when nothing valid is found."""
    changes = CHANGES.count  # read first: a change made meanwhile makes the entry unusable
    selector_config = kind.selector_config(config, **selection_args)
    requested = kind.requested(config)
    key = (kind.name, requested, selector_config, platform, changes)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    capability = platform.get_device_capability()

    def check(name: str) -> tuple[type[Any] | None, list[str]]:
        return check_backend(kind, backends, name, capability, selector_config)

    decision = decide(kind, requested, kind.priorities(platform, selector_config)
                      if requested is None else [], check,
                      lambda: f"{selector_config!r} on {platform!r}")
    if decision.cls is None:
        logger.debug("%s", decision.error)
        raise ValueError(decision.error)
    if logger.isEnabledFor(logging.INFO):
        logger.info("Using %s %s backend (%s) on %r.", decision.name, kind.label,
                    object_path(decision.cls), platform)
    if cache is not None:
        cache.put(key, decision.cls)
    return decision.cls


def check_decode_block_size(backend_class: type[MLADecodeBackend], block_size: int) -> None:
    """``ValueError`` when ``backend_class`` cannot use KV blocks of ``block_size`` tokens,
    listing the block sizes it accepts: what an engine calls at start-up, after selecting its
    decode backend and before allocating the cache. ``TypeError`` for a class that is not a
    decode backend or a block size that is not an int."""
    if not (isinstance(backend_class, type) and issubclass(backend_class, MLADecodeBackend)):
        raise TypeError(f"check_decode_block_size: expected an MLADecodeBackend subclass, got "
                        f"{backend_class!r}")
    if not is_int(block_size):
        raise TypeError(f"CacheConfig.block_size = {block_size!r}: expected an int, got "
                        f"{type(block_size).__name__}")
    if backend_class.supports_block_size(block_size):
        return
    accepted = ", ".join(str(b) for b in backend_class.supported_block_sizes) or "any >= 1"
    raise ValueError(f"CacheConfig.block_size = {block_size}: the selected MLA decode backend "
                     f"{backend_class.get_name()} cannot use it; it accepts block sizes "
                     f"{accepted}")


# -- explaining -------------------------------------------------------------------------------

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
    #: Every backend (every name of the kind, then unknown names a platform listed), in order.
    backends: dict[str, BackendVerdict]
    #: The backend selection picks (None when it raises).
    chosen: str | None
    chosen_class: str | None
    #: The ``ValueError`` message selection raises, when it does.
    error: str | None
    #: On a CPU, the unit the chosen backend's kernel multiplies on for the dtype (and the
    #: cache dtype, where its ``kernel_path`` takes ``kv_cache_dtype``) and why (AMX tiles,
    #: AVX512-BF16 dot products, float32 FMAs ...); present only where the backend says.
    kernel_path: str


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _verdict(kind: BackendKind, backends: Any, name: str, priorities: list[str],
             checked: tuple[type[Any] | None, list[str]]) -> BackendVerdict:
    cls, reasons = checked
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
        valid=not reasons and cls is not None, reasons=reasons)


def explain_selection(kind: BackendKind, config: EngineConfig, platform: Platform,
                      backends: Any, **selection_args: Any) -> SelectionExplanation:
    """Why each backend of ``kind`` is or is not valid, and which one ``decide`` chooses
    (never cached)."""
    selector_config = kind.selector_config(config, **selection_args)
    capability = platform.get_device_capability()
    priorities = kind.priorities(platform, selector_config)
    names = list(kind.catalog)
    names += [n for n in dict.fromkeys(priorities) if n not in names]
    checked = {name: check_backend(kind, backends, name, capability, selector_config)
               for name in names}
    verdicts = {name: _verdict(kind, backends, name, priorities, checked[name])
                for name in names}
    requested = kind.requested(config)
    decision = decide(kind, requested, priorities, checked.__getitem__,
                      lambda: f"{selector_config!r} on {platform!r}")
    # A dimension the shape does not use is 0 (prefill's kv_lora_rank): left out.
    fields = _plain(attrs.asdict(selector_config, recurse=True,
                                 filter=lambda field, value: not (
                                     field.name == "kv_lora_rank" and value == 0)))
    explanation = SelectionExplanation(
        kind=kind.name, platform=repr(platform),
        device_capability=None if capability is None else str(capability),
        dtype=fields.get("dtype", ""), selector_config=fields,
        requested=decision.requested, priorities=priorities, backends=verdicts,
        chosen=decision.name,
        chosen_class=None if decision.cls is None else object_path(decision.cls),
        error=decision.error)
    if "mla_dimensions" in fields:
        explanation["mla_dimensions"] = fields["mla_dimensions"]
    if decision.cls is not None and platform.device_type == "cpu":
        path = _kernel_path(decision.cls, getattr(selector_config, "dtype", None),
                            getattr(selector_config, "kv_cache_dtype", None))
        if path is not None:
            explanation["kernel_path"] = path
    return explanation


def _takes_cache_dtype(describe: Callable[..., object]) -> bool:
    """Whether a ``kernel_path`` accepts ``kv_cache_dtype=`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(describe).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == "kv_cache_dtype" and p.kind != p.POSITIONAL_ONLY)
               or p.kind == p.VAR_KEYWORD for p in params)


def _kernel_path(cls: type[Any], dtype: object, kv_cache_dtype: object = None) -> str | None:
    """``cls.kernel_path(dtype)`` where a backend declares it (a CPU backend saying which unit
    its kernel multiplies on), with ``kv_cache_dtype=`` (the selection's cache dtype name)
    where it takes one: the unit can follow the cache (FP8 rows are not bf16 ones); what it
    raised, as text, if it raises."""
    describe = getattr(cls, "kernel_path", None)
    if not callable(describe) or not isinstance(dtype, torch.dtype):
        return None
    try:
        if isinstance(kv_cache_dtype, str) and _takes_cache_dtype(describe):
            return str(describe(dtype, kv_cache_dtype=kv_cache_dtype))
        return str(describe(dtype))
    except Exception as exc:  # a third party's: said, never raised out of an explanation
        return f"unknown ({_failure(exc)})"
