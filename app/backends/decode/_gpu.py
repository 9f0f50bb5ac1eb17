"""Pieces the GPU decode backends (FLASHINFER_MLA, TOKENSPEED_MLA) share.

- ``DecodeWorkspaces`` / ``WorkspaceSource``: kernel workspaces per (name, device), held by
  a backend instance or passed in (the container's kernel workspaces have the same
  ``get(name, nbytes, device, zeroed=)``), allocated on first use and replaced by a larger
  one when a step needs more. Nothing is module-global: two containers (or two backends)
  share a buffer only when their owner passes the same workspaces to both.
- ``quantize_query_fp8``: the FP8 kernels (trtllm-gen, tokenspeed) read an FP8 query when the
  cache is FP8; the query is quantised per call with its own per-tensor scale (amax / 448, a
  device tensor), which is folded into that call's softmax scale. Nothing is kept between
  calls.
- ``base2_to_natural``: kernels that write a base-2 LSE are converted to the contract's
  natural log (``* ln 2``).
- ``insert_reasons``: a backend whose limits depend on the GPU (which kernel runs there) adds
  its reasons to the base class's list without breaking its fixed order (capability, dtype,
  availability, dimensions, block size, query_len).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from app._types import DeviceCapability
from app._validation import check_int_at_least

if TYPE_CHECKING:
    from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig

__all__ = [
    "FP8_E4M3_MAX",
    "LN2",
    "DecodeWorkspaces",
    "WorkspaceSource",
    "base2_to_natural",
    "check_query_dtype",
    "check_workspaces",
    "insert_reasons",
    "quantize_query_fp8",
]

#: ``ln(2)``: a base-2 LSE times this is the natural-log LSE.
LN2 = math.log(2.0)
#: The largest finite ``float8_e4m3fn`` value.
FP8_E4M3_MAX = 448.0


@runtime_checkable
class WorkspaceSource(Protocol):
    """Where a backend gets its kernel workspaces: ``get(name, nbytes, device, zeroed=)``
    returns a 1-D ``uint8`` tensor of at least ``nbytes`` bytes for kernel ``name`` on
    ``device`` (the container's kernel workspaces have this shape)."""

    def get(self, name: str, nbytes: int, device: torch.device, *,
            zeroed: bool = False) -> torch.Tensor:
        """The workspace ``name`` on ``device``, at least ``nbytes`` bytes."""
        ...


class DecodeWorkspaces:
    """Kernel workspaces, one ``uint8`` buffer per (name, device), made on first use and
    *replaced* by a larger one when a call needs more (the old buffer is dropped, not kept
    beside it). ``zeroed``: made with ``torch.zeros`` (trtllm-gen keeps semaphore counters in
    its workspace and needs them zero on first use). Thread-safe.

    A backend makes its own when none is passed in; pass one to several backends (or the
    container's) to share the buffers of a device."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, name: str, nbytes: int, device: torch.device | str, *,
            zeroed: bool = False) -> torch.Tensor:
        """The workspace ``name`` on ``device``, at least ``nbytes`` (and 1) bytes."""
        check_int_at_least("DecodeWorkspaces.get: nbytes", nbytes, 0)
        key = (name, torch.device(device))
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < max(nbytes, 1):
                make = torch.zeros if zeroed else torch.empty
                buf = make(max(nbytes, 1), dtype=torch.uint8, device=key[1])
                self._buffers[key] = buf
            return buf

    def nbytes(self, name: str, device: torch.device | str) -> int:
        """The size of buffer ``name`` on ``device`` (0 before the first ``get``)."""
        with self._lock:
            buf = self._buffers.get((name, torch.device(device)))
            return 0 if buf is None else int(buf.numel())


def check_workspaces(who: str, workspaces: object) -> WorkspaceSource:
    """``workspaces`` if it has the ``WorkspaceSource`` shape, a new ``DecodeWorkspaces`` for
    None, else ``TypeError``."""
    if workspaces is None:
        return DecodeWorkspaces()
    if not isinstance(workspaces, WorkspaceSource):
        raise TypeError(f"{who}: workspaces must have get(name, nbytes, device, zeroed=) "
                        f"(a DecodeWorkspaces or the container's kernel workspaces), got "
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


def insert_reasons(cls: type[MLADecodeBackend], base: list[str],
                   device_capability: DeviceCapability | None,
                   config: MLADecodeSelectorConfig, *, dtype: Sequence[str] = (),
                   dimensions: Sequence[str] = (), block_size: Sequence[str] = ()
                   ) -> list[str]:
    """``base`` (the base class's reasons) with extra reasons placed in their slots.

    The base list is ordered capability, dtype, availability, dimensions, block size,
    query_len, one reason at most per slot; the slots it filled are recomputed with the same
    predicates, so each extra reason lands right after its slot's base reason."""
    cap_n = int((device_capability is None and cls.requires_device_capability)
                or (device_capability is not None
                    and not cls.supports_compute_capability(device_capability)))
    dtype_n = int(not cls.supports_dtype(config.dtype))
    avail_n = int(not cls.is_available())
    dims_n = int(not cls.supports_mla_dimensions(config.kv_lora_rank,
                                                 config.qk_rope_head_dim))
    block_n = int(not cls.supports_block_size(config.block_size))
    at_dtype = cap_n + dtype_n
    at_dims = at_dtype + avail_n + dims_n
    at_block = at_dims + block_n
    return (base[:at_dtype] + list(dtype) + base[at_dtype:at_dims] + list(dimensions)
            + base[at_dims:at_block] + list(block_size) + base[at_block:])
