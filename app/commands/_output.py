"""Shared output helpers for the CLI subcommands."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def print_text(text: str = "") -> None:
    """Print ``text`` and a newline on stdout (the human-readable form of a command)."""
    sys.stdout.write(text + "\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with left-aligned columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_mapping(data: dict[str, Any]) -> str:
    """``key: value`` lines, keys aligned."""
    width = max((len(k) for k in data), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in data.items())
