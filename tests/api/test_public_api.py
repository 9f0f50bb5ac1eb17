"""The public API is a promise: it changes only on purpose (docs/public-api.md).

``tests/api/public_api.txt`` records every public name with its signature
(``tests.api.surface``); the first test fails, saying what was removed, changed or added and
what to do, whenever the package's surface differs from it.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import attrs

from tests.api.surface import (
    SNAPSHOT,
    UPDATE_COMMAND,
    collect,
    collect_fresh,
    differences,
    parse,
    render,
    render_signature,
)


def test_the_public_api_matches_the_recorded_snapshot() -> None:
    problem = differences(parse(SNAPSHOT.read_text()), collect_fresh())
    assert problem == "", problem


def test_a_removed_name_or_changed_signature_fails_saying_what_and_what_to_do() -> None:
    recorded = {"app.f": "function(x: int) -> None", "app.g": "function() -> None",
                "app.h": "function() -> None"}
    current = {"app.f": "function(x: int, /) -> None", "app.h": "function() -> None",
               "app.k": "function() -> int"}
    message = differences(recorded, current)
    assert "REMOVED (1)" in message and "  - app.g: function() -> None" in message
    assert "CHANGED SIGNATURE (1)" in message
    assert "was: function(x: int) -> None" in message
    assert "now: function(x: int, /) -> None" in message
    assert "ADDED (1)" in message and "  + app.k: function() -> int" in message
    assert "an alias" in message and "CHANGELOG.md" in message and UPDATE_COMMAND in message


def test_a_pure_addition_fails_too_and_says_nothing_breaks() -> None:
    message = differences({"app.f": "function()"}, {"app.f": "function()", "app.g": "class"})
    assert "ADDED (1)" in message and "nothing breaks" in message
    assert "REMOVED" not in message and "alias" not in message
    assert differences({"app.f": "function()"}, {"app.f": "function()"}) == ""


def test_the_snapshot_reads_back_as_written() -> None:
    surface = {"app.b": "function(x: dict[str, int] = {}) -> None", "app.a": "class(object)"}
    assert parse(render(surface)) == surface
    assert render(surface).splitlines()[0].startswith("app.a: ")


class Color(enum.Enum):
    """A sample enum."""

    RED = 1
    BLUE = 2


class Level(enum.IntEnum):
    """A sample int enum (its members are ints too)."""

    LOW = 0


def _sample(a: int, /, b: str = "x", *args: Any, c: float, d: Color = Color.RED,
            e: Level = Level.LOW, **kw: object) -> list[int]:
    return []


def test_a_signature_renders_kinds_annotations_as_written_and_defaults() -> None:
    assert render_signature(_sample) == (
        "(a: int, /, b: str = 'x', *args: Any, c: float, d: Color = Color.RED, "
        "e: Level = Level.LOW, **kw: object)"
        " -> list[int]")

    def keyword_only(*, flag: bool = True) -> None: ...

    def written_default(items: tuple[object, ...] = SENTINELS) -> None: ...

    assert render_signature(keyword_only) == "(*, flag: bool = True) -> None"
    # An object default reads as the source wrote it (no repr, no address).
    assert render_signature(written_default) == (
        "(items: tuple[object, ...] = SENTINELS) -> None")


SENTINELS = (object(),)


class _Reader(Protocol):
    size: int

    def read(self, n: int = -1) -> bytes: ...


@attrs.frozen(kw_only=True)
class _Point:
    x: int = 0
    tags: list[str] = attrs.field(factory=list)

    def norm(self, p: int = 2) -> float:
        return float(self.x)

    @property
    def doubled(self) -> int:
        return 2 * self.x


def test_classes_enums_and_attrs_fields_are_recorded_without_external_bases() -> None:
    import sys
    import types

    module = types.ModuleType("app._surface_sample")
    module.__all__ = ["Color", "Point", "Reader"]  # type: ignore[attr-defined]
    _Point.__module__ = Color.__module__ = _Reader.__module__ = module.__name__
    _Point.__init__.__module__ = module.__name__  # as attrs names it for a class made there
    module.Color, module.Point = Color, _Point  # type: ignore[attr-defined]
    module.Reader = _Reader  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        surface = collect([module.__name__])
    finally:
        del sys.modules[module.__name__]
    assert surface == {
        "app._surface_sample.Color": "enum(Enum)",
        "app._surface_sample.Color.<members>": "RED, BLUE",
        "app._surface_sample.Point": "class(object)",
        "app._surface_sample.Point.__init__":
            "constructor(self, *, x: int = 0, tags: list[str] = <factory>) -> None",
        "app._surface_sample.Point.doubled": "property",
        "app._surface_sample.Point.norm": "method(self, p: int = 2) -> float",
        "app._surface_sample.Point.tags": "attribute",
        "app._surface_sample.Point.x": "attribute",
        # typing's stand-in constructor of a Protocol is not ours: left out.
        "app._surface_sample.Reader": "class(Protocol)",
        "app._surface_sample.Reader.read": "method(self, n: int = -1) -> bytes",
        "app._surface_sample.Reader.size": "attribute",
    }
