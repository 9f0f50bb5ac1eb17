"""Input-checking helpers shared across the package."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import torch

#: The largest value an int32 holds: token counts and block ids are stored as int32.
INT32_MAX = 2**31 - 1
#: The largest seed a user may give (an int64, as the command line's ``--seed``); what is
#: derived from it (``seed + layer``, ``seed + 0x5EED``) stays within a torch generator's
#: uint64 seed.
MAX_SEED = 2**63 - 1
#: The largest seed a ``torch.Generator`` takes (``manual_seed``: a uint64).
MAX_GENERATOR_SEED = 2**64 - 1


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (``True`` is not a size or an index)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_range_text(minimum: int | None, maximum: int | None) -> str:
    """``"an int >= 1"``, ``"an int in [0, 9]"``, ``"an int <= 5"`` or ``"an int"``."""
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def check_int(name: str, value: object, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]`` (either bound may be
    None); else ``TypeError`` (a bool, float, string ...) or ``ValueError`` (out of range), both
    worded ``"<name>: expected an int in [lo, hi], got <value>"``. ``name`` says where the value
    came from (``"ModelConfig.num_heads"``, ``"kv.toml: layers[0].head_size"``)."""
    allowed = int_range_text(minimum, maximum)
    if not is_int(value):
        raise TypeError(f"{name}: expected {allowed}, got {value!r} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}: expected {allowed}, got {value!r}")
    return value


def check_int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else ``ValueError`` naming
    ``name`` (which may carry its owner's prefix, e.g. ``"CudaPlatform: device_index"``)."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_positive_finite(name: str, value: object) -> float:
    """``float(value)`` if it is a real number (not a bool) that is finite and > 0; else
    ``TypeError`` (not a number) or ``ValueError`` (inf, nan, zero or negative)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive, finite float, got {value!r} "
                        f"({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name}: expected a positive, finite float, got {value!r}")
    return number


def check_seed(name: str, value: object, maximum: int = MAX_SEED) -> int:
    """``value`` if it is an int (not a bool) in ``[0, maximum]`` (``MAX_SEED`` for a seed a
    user gives); else ``TypeError``/``ValueError`` naming ``name`` and the allowed range (torch
    would say only "Overflow when unpacking long long")."""
    return check_int(name, value, 0, maximum)


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: the same storage and intersecting byte spans
    (a kernel writing ``out`` while it reads ``q`` or the cache there would read its own
    output: a silent wrong result)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
