"""Pieces the GPU decode backends (FLASHINFER_MLA, TOKENSPEED_MLA) share.

- ``check_workspaces``: the kernel workspaces a backend was given (the container's
  ``app.backends.workspaces.KernelWorkspaces``), or its own. Nothing is module-global: two
  containers (or two backends) share a buffer only when their owner passes the same
  workspaces to both.
- ``quantize_query_fp8``: the FP8 kernels (trtllm-gen, tokenspeed) read an FP8 query when the
  cache is FP8; the query is quantised per call with its own per-tensor scale (amax / 448, a
  device tensor), which is folded into that call's softmax scale. Nothing is kept between
  calls.
- ``base2_to_natural``: kernels that write a base-2 LSE are converted to the contract's
  natural log (``* ln 2``).
- ``insert_reasons``: a backend whose limits depend on the GPU (which kernel runs there) adds
  its reasons to the base class's slots (``MLADecodeBackend.reason_slots``), so that the fixed
  order holds (capability, dtype, availability, dimensions, block size, query_len).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from app._types import DeviceCapability
from app.backends.workspaces import KernelWorkspaces, WorkspaceSource

if TYPE_CHECKING:
    from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig

__all__ = [
    "FP8_E4M3_MAX",
    "LN2",
    "base2_to_natural",
    "check_query_dtype",
    "check_workspaces",
    "fp8_query_reasons",
    "insert_reasons",
    "quantize_query_fp8",
]

#: ``ln(2)``: a base-2 LSE times this is the natural-log LSE.
LN2 = math.log(2.0)
#: The largest finite ``float8_e4m3fn`` value.
FP8_E4M3_MAX = 448.0


def check_workspaces(who: str, workspaces: object) -> WorkspaceSource:
    """``workspaces`` if it has the ``WorkspaceSource`` shape, a new ``KernelWorkspaces`` for
    None, else ``TypeError``."""
    if workspaces is None:
        return KernelWorkspaces()
    if not isinstance(workspaces, WorkspaceSource):
        raise TypeError(f"{who}: workspaces must have get(name, nbytes, device, zeroed=) "
                        f"(the container's KernelWorkspaces), got "
                        f"{type(workspaces).__name__}")
    return workspaces


def quantize_query_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` as contiguous ``float8_e4m3fn`` with a per-tensor scale: ``q ~= q8 * scale``.

    ``scale`` is a one-element float32 tensor on ``q``'s device, ``amax / 448`` over this
    call's finite query values (1 when there are none), computed without a host sync; a
    non-finite query value becomes NaN (e4m3fn has no infinity), so only its own row is
    poisoned."""
    x = q.detach().float()
    finite = torch.isfinite(x)
    amax = x.abs().masked_fill(~finite, 0.0).amax().reshape(1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scaled = x / scale
    # e4m3fn has no infinity (a cast saturates it to 448): non-finite values become NaN
    q8 = torch.where(finite, scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX), float("nan"))
    return q8.to(torch.float8_e4m3fn).contiguous(), scale


def base2_to_natural(lse_base2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = lse_base2 * ln 2`` (shapes must match; ``out`` may be ``lse_base2``)."""
    if tuple(lse_base2.shape) != tuple(out.shape):
        raise ValueError(f"kernel LSE shape: expected {list(out.shape)}, got "
                         f"{list(lse_base2.shape)}")
    torch.mul(lse_base2, LN2, out=out)
    return out


def check_query_dtype(what: str, q: torch.Tensor, allowed: Sequence[torch.dtype],
                      kv_cache_dtype: torch.dtype) -> None:
    """``ValueError`` unless ``q.dtype`` is one the kernel reads with this cache dtype."""
    if q.dtype not in allowed:
        raise ValueError(f"{what}: with a {kv_cache_dtype} cache the query dtype must be one "
                         f"of {[str(d) for d in allowed]}, got {q.dtype}")


def fp8_query_reasons(config: MLADecodeSelectorConfig) -> list[str]:
    """The GPU kernels read an FP8 (e4m3) cache with a bf16 query (quantised to e4m3 per call
    where the kernel takes an FP8 one): another model dtype is a reason (issue 36)."""
    if config.kv_cache_dtype in ("fp8", "fp8_e4m3") and config.dtype != torch.bfloat16:
        return [f"kv_cache_dtype {config.kv_cache_dtype!r} needs a bfloat16 model (the "
                f"kernels read an e4m3 cache with a bf16 query), got {config.dtype}"]
    return []


def insert_reasons(cls: type[MLADecodeBackend], device_capability: DeviceCapability | None,
                   config: MLADecodeSelectorConfig, *, dtype: Sequence[str] = (),
                   dimensions: Sequence[str] = (), block_size: Sequence[str] = ()
                   ) -> list[str]:
    """The base class's reasons (``cls.reason_slots``) with extra reasons added to their
    slots, in its fixed order: each lands right after its slot's base reason."""
    slots = cls.reason_slots(device_capability, config)
    slots["dtype"] += dtype
    slots["dimensions"] += dimensions
    slots["block_size"] += block_size
    return [reason for reasons in slots.values() for reason in reasons]
