"""Backend kinds: what one registry implementation needs to serve prefill and decode alike.

A ``BackendKind`` names a kind's base class, its built-in table, the names its enum holds
(``BackendNames``, built-ins then ``CUSTOM`` then run-time additions), the container attribute
holding its providers, the platform method giving its priorities, the config field that forces
one, and how to build the selector config the backends validate against. The registry
(``app.backends.registry``), the selection (``app.backends.selection``) and the container are
written once against this; ``PREFILL`` and ``DECODE`` are the two instances.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.prefill.base import MLAPrefillBackend, MLAPrefillSelectorConfig
from app.backends.table import CUSTOM, DECODE_BACKENDS, PREFILL_BACKENDS, BackendTable

if TYPE_CHECKING:
    from app.config import EngineConfig

__all__ = ["DECODE", "KINDS", "PREFILL", "BackendKind", "BackendNames"]


class BackendNames:
    """The names of one kind's backends (its enum's members), thread-safe, in order."""

    def __init__(self, label: str, enum_name: str, names: list[str]) -> None:
        self._label = label
        self._enum_name = enum_name
        self._names = list(names)
        self.lock = threading.RLock()

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def add(self, name: str) -> None:
        """Append ``name`` (the caller holds ``lock`` and has checked it)."""
        if name not in self._names:
            self._names.append(name)

    def unknown_message(self, name: object) -> str:
        """vLLM's wording for a name that is not a member."""
        return (f"Unknown {self._label} backend: '{name}'. "
                f"Valid options are: {', '.join(self._names)}")

    def resolve(self, name: str) -> str:
        """The member name ``name`` means: exact first (run-time members may be lower case),
        then upper case; ``ValueError`` listing the valid names otherwise."""
        if name in self._names:
            return name
        if name.upper() in self._names:
            return name.upper()
        raise ValueError(self.unknown_message(name))


def _prefill_selector_config(config: EngineConfig, **_: Any) -> MLAPrefillSelectorConfig:
    return MLAPrefillSelectorConfig.from_engine_config(config)


def _decode_selector_config(config: EngineConfig, *, query_len: int = 1,
                            **_: Any) -> MLADecodeSelectorConfig:
    return MLADecodeSelectorConfig.from_engine_config(config, query_len=query_len)


@attrs.frozen(eq=False)
class BackendKind:
    """One kind of backend, as the registry, the selection and the container see it."""

    #: ``"prefill"`` or ``"decode"``.
    name: str
    #: How messages name it: ``"MLA prefill"``.
    label: str
    base: type[Any]
    table: BackendTable
    names: BackendNames
    #: The enum's and the public functions' names (for messages).
    enum_name: str
    register_name: str
    #: The container attribute holding one provider per backend (``mla_prefill_backends``).
    container_attr: str
    #: The ``Platform`` method returning this kind's priority list.
    priorities_attr: str
    #: The ``AttentionConfig`` field that forces a backend (a name, or None for auto).
    config_attr: str
    #: ``(EngineConfig, **selection arguments) -> selector config``.
    selector_config: Callable[..., Any]

    def requested(self, config: EngineConfig) -> str | None:
        """The backend name ``config`` forces (None: automatic selection)."""
        value: str | None = getattr(config.attention, self.config_attr)
        return value

    def priorities(self, platform: Any, selector_config: Any) -> list[str]:
        """The platform's priority list for this kind, as names."""
        items = getattr(platform, self.priorities_attr)(selector_config)
        return [getattr(item, "name", item) if not isinstance(item, str) else item
                for item in items]

    def __repr__(self) -> str:
        return f"BackendKind({self.name!r})"


def _kind(name: str, label: str, base: type[Any], table: BackendTable, enum_name: str,
          selector_config: Callable[..., Any]) -> BackendKind:
    snake = label.lower().replace(" ", "_")
    return BackendKind(
        name=name, label=label, base=base, table=table,
        names=BackendNames(label, enum_name, [entry.name for entry in table] + [CUSTOM]),
        enum_name=enum_name, register_name=f"register_{snake}_backend",
        container_attr=f"{snake}_backends", priorities_attr=f"{snake}_backend_priorities",
        config_attr=f"{snake}_backend", selector_config=selector_config)


PREFILL = _kind("prefill", "MLA prefill", MLAPrefillBackend, PREFILL_BACKENDS,
                "MLAPrefillBackendEnum", _prefill_selector_config)
DECODE = _kind("decode", "MLA decode", MLADecodeBackend, DECODE_BACKENDS,
               "MLADecodeBackendEnum", _decode_selector_config)

#: Every kind, by name.
KINDS: dict[str, BackendKind] = {PREFILL.name: PREFILL, DECODE.name: DECODE}
