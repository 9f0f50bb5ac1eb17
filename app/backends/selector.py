"""The selection facades: ``get_mla_prefill_backend(config)``, ``get_mla_decode_backend``, their
``explain_*`` forms, and the start-up check that the KV block size suits the decode backend.

Each takes ``container=`` (default: the active container) and passes that container's config,
platform, backend providers and selection cache to ``app.backends.selection``; the
container's own ``mla_prefill_backend_class`` / ``mla_decode_backend_class`` providers call the
same function with the same arguments. See ``app.backends.selection`` for the rules and the
errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app._validation import is_int
from app.backends.kinds import DECODE, PREFILL, BackendKind
from app.backends.selection import (
    BackendVerdict,
    SelectionExplanation,
    explain_selection,
    select_backend,
)

if TYPE_CHECKING:
    from app.backends.decode.base import MLADecodeBackend
    from app.backends.prefill.base import MLAPrefillBackend
    from app.config import EngineConfig
    from app.containers import Application

__all__ = [
    "BackendVerdict",
    "SelectionExplanation",
    "check_decode_block_size",
    "explain_mla_decode_selection",
    "explain_mla_prefill_selection",
    "get_mla_decode_backend",
    "get_mla_prefill_backend",
    "select_for_container",
]


def _container(container: Application | None) -> Application:
    if container is not None:
        return container
    from app.containers import get_container

    return get_container()


def _select(kind: BackendKind, config: EngineConfig | None, container: Application | None,
            **selection_args: Any) -> type[Any]:
    c = _container(container)
    return select_backend(kind, c.config() if config is None else config, c.platform(),
                          getattr(c, kind.container_attr)(), c.selection_cache(),
                          **selection_args)


def _explain(kind: BackendKind, config: EngineConfig | None, container: Application | None,
             **selection_args: Any) -> SelectionExplanation:
    c = _container(container)
    return explain_selection(kind, c.config() if config is None else config, c.platform(),
                             getattr(c, kind.container_attr)(), **selection_args)


def get_mla_prefill_backend(config: EngineConfig | None = None, *,
                            container: Application | None = None
                            ) -> type[MLAPrefillBackend]:
    """The MLA prefill backend class for ``config`` (default: the container's config) on the
    platform of ``container`` (default: the active container). ``ValueError`` when a forced
    backend is unknown or invalid here, or when no backend in the platform's priority list is
    valid."""
    cls: type[MLAPrefillBackend] = _select(PREFILL, config, container)
    return cls


def explain_mla_prefill_selection(config: EngineConfig | None = None, *,
                                  container: Application | None = None
                                  ) -> SelectionExplanation:
    """Why each prefill backend is or is not valid for ``config`` on ``container``'s platform
    (defaults as in ``get_mla_prefill_backend``), and which one is chosen. Never cached."""
    return _explain(PREFILL, config, container)


def get_mla_decode_backend(config: EngineConfig | None = None, *, query_len: int = 1,
                           container: Application | None = None) -> type[MLADecodeBackend]:
    """The MLA decode backend class for ``config`` and ``query_len`` (tokens per request per
    step, 1..16; multi-token prediction selects differently) on ``container``'s platform.
    Errors as in ``get_mla_prefill_backend``."""
    cls: type[MLADecodeBackend] = _select(DECODE, config, container, query_len=query_len)
    return cls


def explain_mla_decode_selection(config: EngineConfig | None = None, *, query_len: int = 1,
                                 container: Application | None = None
                                 ) -> SelectionExplanation:
    """Why each decode backend is or is not valid (as ``explain_mla_prefill_selection``)."""
    return _explain(DECODE, config, container, query_len=query_len)


def check_decode_block_size(backend_class: type[MLADecodeBackend], block_size: int) -> None:
    """``ValueError`` when ``backend_class`` cannot use KV blocks of ``block_size`` tokens,
    listing the block sizes it accepts: what an engine calls at start-up, after selecting its
    decode backend and before allocating the cache."""
    from app.backends.decode.base import MLADecodeBackend

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


def select_for_container(container: Application) -> type[MLAPrefillBackend]:
    """The prefill backend class for ``container``'s own config and platform, whichever
    container is active (what its ``mla_prefill_backend_class`` provider gives)."""
    return get_mla_prefill_backend(None, container=container)
