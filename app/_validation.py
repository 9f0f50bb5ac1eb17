"""Input-checking helpers shared across the package."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (``True`` is not a size or an index)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else ``ValueError`` naming
    ``name`` (which may carry its owner's prefix, e.g. ``"CudaPlatform: device_index"``)."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
