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
#: float32's largest finite value and smallest normal one: the range of an attention scale,
#: which every kernel multiplies in float32 (a float64 1e39 would be inf there, 1e-39 0).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
#: The largest softmax scale (times ``k_scale``) a kernel can use: kernels that take exp2
#: multiply it by log2(e) in float32 first.
MAX_ATTENTION_SCALE = FLOAT32_MAX / 1.4426950408889634


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
    """Whether ``a`` and ``b`` may share memory: intersecting byte spans on one device (a
    kernel writing ``out`` while it reads ``q`` or the cache there would read its own output:
    a silent wrong result). Addresses, not storage objects, are compared: two tensors made
    over one buffer (``torch.from_numpy``, ``frombuffer``, DLPack) have storages of their
    own."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_dense(what: str, t: torch.Tensor) -> None:
    """``TypeError`` unless ``t`` is a dense (``torch.strided``) tensor, ``ValueError`` when it
    is on the meta device: a kernel reads memory, and neither has any to read."""
    import torch

    if t.layout != torch.strided:
        raise TypeError(f"{what}: expected a dense (torch.strided) tensor, got layout "
                        f"{t.layout}")
    if t.device.type == "meta":
        raise ValueError(f"{what}: expected a tensor with data, got one on the meta device")


def check_writable_out(what: str, out: torch.Tensor) -> None:
    """``out`` can be written in place, element by element, before any kernel runs; else
    ``TypeError`` / ``ValueError``: sparse or meta (``check_dense``), requiring grad while
    grad mode is on (the kernels write it outside autograd; torch's own ``out=`` arguments
    refuse it too), an inference tensor outside ``torch.inference_mode()`` (torch refuses to
    update it there), or elements that may share an address (an ``expand``-ed or
    ``as_strided`` view)."""
    import torch

    check_dense(what, out)
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{what} must not require grad (it is written in place, outside "
                         f"autograd); pass a detached tensor or run under torch.no_grad()")
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{what} is an inference tensor and cannot be written outside "
                         f"torch.inference_mode()")
    if may_overlap_itself(out):
        raise ValueError(f"{what} must not have elements that share memory, got shape "
                         f"{list(out.shape)} strides {list(out.stride())}")


def may_overlap_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share an address: taking its dims of more than one
    element by stride, smallest first, each stride must reach past everything the smaller
    ones span. An exotic view that interleaves its dims without overlapping fails this test
    too (safe to refuse)."""
    if t.numel() <= 1 or t.is_contiguous():  # a flag torch keeps: the common out= answers here
        return False
    reach = 0  # the highest element offset the smaller dims can reach
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True)
                               if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False
