"""What the prefill and decode contracts share: the one scale check and the ``out=`` rule.

Both bases' template methods (``MLAPrefillBackend.run_prefill_new_tokens`` /
``run_prefill_context_chunk`` and ``MLADecodeBackend.run_decode``) and both constructors use
these, so every backend of either kind, built-in or third party, refuses the same scales with
the same words and treats a caller's ``out=`` the same way:

- ``check_attention_scale``: a scale is a real number (not a bool), finite, > 0 and within
  float32's normal range (every kernel multiplies by it in float32), at most ``upper``
  (``MAX_ATTENTION_SCALE`` for a softmax scale: kernels that take exp2 multiply it by
  log2(e) first). A one-element float tensor is read on the host where ``tensor_ok``.
- ``writes_in_place``: whether a kernel may write straight into ``out``: contiguous, not a
  negative view, sharing no memory with an input (an ``out`` that does is written after the
  kernel, never during it: the kernel would read its own output).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from app._validation import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    MAX_ATTENTION_SCALE,
    check_dense,
    tensors_overlap,
)

__all__ = ["check_attention_scale", "check_return_flag", "writes_in_place"]


def _number(who: str, name: str, value: object, tensor_ok: bool) -> float | None:
    """``value`` as a float, or None when it is no real number (a one-element float tensor
    counts where ``tensor_ok``)."""
    if tensor_ok and isinstance(value, torch.Tensor):
        check_dense(f"{who}: {name}", value)
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{who}: {name} must be a finite float > 0 or a one-element float "
                             f"tensor, got a tensor of shape {list(value.shape)} dtype "
                             f"{value.dtype}")
        value = float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        return math.inf


def check_attention_scale(who: str, name: str, value: object, *,
                          upper: float = MAX_ATTENTION_SCALE, tensor_ok: bool = False) -> float:
    """``value`` as a float if it is a real number (not a bool) in ``[FLOAT32_TINY, upper]``
    (``upper`` at most ``FLOAT32_MAX``); else ``ValueError`` naming ``who``, ``name``, the range
    and the value. ``tensor_ok``: a one-element float tensor is read on the host."""
    if type(value) is float and FLOAT32_TINY <= value <= upper:   # every call's own scale
        return value
    number = _number(who, name, value, tensor_ok)
    if number is not None and FLOAT32_TINY <= number <= upper:
        return number
    why = ("the kernels multiply by it, and by log2(e), in float32"
           if upper < FLOAT32_MAX else "the kernels multiply by it in float32")
    outside_float32 = (number is not None and math.isfinite(number) and number > 0
                       and not FLOAT32_TINY <= number <= FLOAT32_MAX)
    prefix = f"{name} must be within float32's normal range: " if outside_float32 else ""
    shown = f"{value!r}" if number is not None else f"{value!r} ({type(value).__name__})"
    raise ValueError(f"{who}: {prefix}{name} must be a positive, finite float in "
                     f"[{FLOAT32_TINY:.4g}, {upper:.4g}] ({why}), got {shown}")


def check_return_flag(who: str, name: str, value: object) -> bool:
    """``value`` if it is a bool (``return_softmax_lse``); else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be a bool, got {value!r}")
    return value


def writes_in_place(out: torch.Tensor | None, inputs: Iterable[torch.Tensor]) -> bool:
    """Whether a kernel may write into ``out`` directly (see the module docstring)."""
    return (out is not None and out.is_contiguous() and not out.is_neg()
            and not any(tensors_overlap(out, t) for t in inputs))
