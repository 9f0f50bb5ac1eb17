"""Input-checking helpers shared across the package."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (``True`` is not a size or an index)."""
    return isinstance(value, int) and not isinstance(value, bool)
