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
  negative view, sharing no memory with any tensor the kernel reads (q, the cache, and the
  integer ones too: indices, block tables, lengths). An ``out`` that does is written after the
  kernel, never during it: the kernel would read its own output (a corrupted index is an
  out-of-bounds read in a native kernel).
- ``check_out_spares_step``: an ``out`` sharing memory with the step's own tensors (block
  tables, lengths, prefix sums: checked once per step, read by every later call) is a
  ``ValueError``: written after the kernel it would still corrupt every later call of the step.
- ``check_hook_result``: a kernel hook writes the ``out`` it was handed and returns None; one
  that returns a tensor instead (its result, not written into ``out``) is a ``TypeError``
  naming the hook and the class, never an unwritten buffer handed to the caller.
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

__all__ = ["check_attention_scale", "check_hook_result", "check_out_spares_step",
           "check_return_flag", "checked_returned_lse", "describe_value", "writes_in_place"]


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
    """Whether a kernel may write into ``out`` directly (see the module docstring): ``inputs``
    are every tensor the kernel reads, integer ones included (O(number of inputs))."""
    return (out is not None and out.is_contiguous() and not out.is_neg()
            and not any(tensors_overlap(out, t) for t in inputs))


def check_hook_result(backend: object, hook: str, returned: object, out: torch.Tensor) -> None:
    """``TypeError`` unless the kernel hook ``hook`` of ``backend`` returned None (or the very
    ``out`` it was handed): the base hands the caller ``out``, so a result returned instead of
    written would be lost, and the caller would get a buffer the hook never wrote."""
    if returned is None or returned is out:
        return
    got = (f"a {returned.dtype} tensor {list(returned.shape)}"
           if isinstance(returned, torch.Tensor) else type(returned).__name__)
    raise TypeError(f"{type(backend).__name__}.{hook} returned {got} instead of writing the "
                    f"out it was handed ({out.dtype} {list(out.shape)}) and returning None: "
                    f"a hook writes its result into out (out.copy_(result) if it computed it "
                    f"elsewhere); the base returns out to the caller")


def check_out_spares_step(who: str, out: object, step: Iterable[torch.Tensor]) -> None:
    """``ValueError`` when ``out`` shares memory with one of the step's tensors ``step`` (see
    the module docstring; O(number of tensors))."""
    if isinstance(out, torch.Tensor) and any(tensors_overlap(out, t) for t in step):
        raise ValueError(f"{who}: out shares memory with the step's metadata (its block "
                         f"tables, lengths or prefix sums, checked once and read by every "
                         f"call of the step): pass an out of its own")

def describe_value(value: object) -> str:
    """A returned value in words, for the errors of a backend's own verbs."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {list(value.shape)} on {value.device}"
    if isinstance(value, tuple):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    return type(value).__name__


def checked_returned_lse(who: str, result: object, lse: object, shape: list[int],
                         device: torch.device) -> torch.Tensor:
    """The LSE a backend's own verb returned, contiguous: ``TypeError`` (naming ``who`` and
    what it returned) unless it is a dense float32 ``shape`` tensor on ``device``."""
    if not isinstance(lse, torch.Tensor) or list(lse.shape) != shape \
            or lse.dtype != torch.float32 or lse.layout != torch.strided \
            or lse.device != device:
        raise TypeError(f"{who} returned {describe_value(result)}; expected (out, lse) with "
                        f"lse {shape} float32 on {device} (natural log, head-major)")
    return lse.contiguous()
