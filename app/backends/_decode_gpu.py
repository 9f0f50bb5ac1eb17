"""Pieces the GPU decode backends (FLASHINFER_MLA, TOKENSPEED_MLA) share.

- ``KernelWorkspace``: one kernel workspace per device, held by a backend instance (or passed
  to several), allocated on first use and replaced by a larger one when a step needs more.
  Nothing is module-global, so two containers (or two backends) never share a buffer unless
  their owner passes the same ``KernelWorkspace`` to both.
- ``quantize_query_fp8``: the FP8 kernels (trtllm-gen, tokenspeed) read an FP8 query when the
  cache is FP8; the query is quantised per call with its own per-tensor scale (amax / 448),
  which is folded into that call's softmax scale. Nothing is kept between calls.
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
from typing import TYPE_CHECKING

import torch

from app._types import DeviceCapability
from app._validation import check_int_at_least

if TYPE_CHECKING:
    from app.backends.decode_base import MLADecodeBackend, MLADecodeSelectorConfig

__all__ = [
    "FP8_E4M3_MAX",
    "LN2",
    "KernelWorkspace",
    "base2_to_natural",
    "check_query_dtype",
    "insert_reasons",
    "quantize_query_fp8",
]

#: ``ln(2)``: a base-2 LSE times this is the natural-log LSE.
LN2 = math.log(2.0)
#: The largest finite ``float8_e4m3fn`` value.
FP8_E4M3_MAX = 448.0


class KernelWorkspace:
    """One kernel workspace per device: ``get(device, nbytes)`` returns a 1-D tensor of at
    least ``nbytes`` bytes (``dtype`` elements), allocated on first use and *replaced* by a
    larger one when a call needs more (the old buffer is dropped, not kept beside it).

    ``zeroed``: allocate with ``torch.zeros`` (trtllm-gen keeps semaphore counters in its
    workspace and needs them zero on first use). Thread-safe. ``min_bytes`` is the smallest
    buffer ever allocated (kernels that take a fixed-size workspace ask for it)."""

    def __init__(self, *, dtype: torch.dtype = torch.uint8, zeroed: bool = False,
                 min_bytes: int = 0) -> None:
        if not isinstance(dtype, torch.dtype) or dtype.itemsize != 1:
            raise ValueError(f"KernelWorkspace: dtype must be a one-byte torch.dtype, got "
                             f"{dtype!r}")
        self.dtype = dtype
        self.zeroed = bool(zeroed)
        self.min_bytes = check_int_at_least("KernelWorkspace: min_bytes", min_bytes, 0)
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device | str, nbytes: int = 0) -> torch.Tensor:
        """The workspace on ``device``, at least ``max(nbytes, min_bytes)`` bytes."""
        check_int_at_least("KernelWorkspace.get: nbytes", nbytes, 0)
        dev = torch.device(device)
        want = max(nbytes, self.min_bytes, 1)
        with self._lock:
            buf = self._buffers.get(dev)
            if buf is None or buf.numel() < want:
                make = torch.zeros if self.zeroed else torch.empty
                buf = make(want, dtype=self.dtype, device=dev)
                self._buffers[dev] = buf
            return buf

    def nbytes(self, device: torch.device | str) -> int:
        """The size of the current buffer on ``device`` (0 before the first ``get``)."""
        with self._lock:
            buf = self._buffers.get(torch.device(device))
            return 0 if buf is None else int(buf.numel())


def quantize_query_fp8(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``q`` as contiguous ``float8_e4m3fn`` with a per-tensor scale: ``q ~= q8 * scale``.

    The scale is ``amax(|q|) / 448`` of this call's query (1 for an all-zero query); reading it
    as a Python float is one device sync, the price of an FP8 cache with a 16-bit query."""
    amax = float(q.detach().abs().amax()) if q.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError(f"FP8 query quantisation: the query holds non-finite values "
                         f"(amax {amax})")
    scale = amax / FP8_E4M3_MAX if amax > 0.0 else 1.0
    q8 = (q.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q8.contiguous(), scale


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
