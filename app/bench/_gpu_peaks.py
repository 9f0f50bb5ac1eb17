"""A CUDA GPU's peaks, measured with torch: the roofline of ``bench prefill`` / ``decode`` rows.

The CPU's peaks come from a probe of our own (``app.bench._peaks``); a GPU's from torch:

- ``bf16_matmul``, ``fp16_matmul``, ``fp32_matmul``: ``torch.mm`` of ``n x n`` matrices of that
  dtype (fp32 with TF32 off), ``2 n^3`` FLOPs a call: the compute bound of a kernel that
  multiplies in that dtype (a bf16 attention kernel runs q.k and p.v on the bf16 tensor cores).
  Before issue 35 the GPU rows were read against an fp32 matmul (47 TFLOP/s on the H100,
  where its bf16 matmul is an order of magnitude faster) and against no peak at all.
- the memory bandwidth: a device-to-device copy of a buffer far larger than the L2 cache,
  counted as read plus write (twice the buffer's bytes a call): the bound of a memory-bound
  kernel (decode reads its cache once).

Each measurement is the best of ``repeat`` calls, each between two synchronisations
(``app.bench._timing.time_calls``). The timer is a parameter so that the arithmetic and the
tensors each kind uses are tested on a CPU machine; nothing here has run on a GPU yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from app.bench._timing import time_calls

__all__ = ["BF16_MATMUL", "FP16_MATMUL", "FP32_MATMUL", "GPU_PEAK_BYTES", "MATMUL_N",
           "GpuPeakProbe", "matmul_kind"]

BF16_MATMUL = "bf16_matmul"
FP16_MATMUL = "fp16_matmul"
FP32_MATMUL = "fp32_matmul"
_DTYPES = {BF16_MATMUL: torch.bfloat16, FP16_MATMUL: torch.float16, FP32_MATMUL: torch.float32}
#: The side of the square matmuls: 1.1 TFLOP a call, far from launch-bound on any GPU.
MATMUL_N = 8192
#: Device memory the matmul operands of every kind take at most (for memory checks).
GPU_PEAK_BYTES = 3 * MATMUL_N * MATMUL_N * (2 + 2 + 4)

#: ``timer(fn, repeat)``: the best seconds of ``repeat`` calls of ``fn``.
Timer = Callable[[Callable[[], object], int], float]


def matmul_kind(dtype: torch.dtype) -> str:
    """The matmul peak that bounds a GPU kernel multiplying in ``dtype`` (float32 for any
    other dtype: an FP8 cache is multiplied in its query's 16-bit dtype, or converted)."""
    return {torch.bfloat16: BF16_MATMUL, torch.float16: FP16_MATMUL}.get(dtype, FP32_MATMUL)


def _cuda_timer(device: torch.device) -> Timer:
    def sync() -> None:
        torch.cuda.synchronize(device)

    def best(fn: Callable[[], object], repeat: int) -> float:
        return float(time_calls(fn, repeat=repeat, warmup=1, sync=sync)["min_s"])
    return best


class GpuPeakProbe:
    """A GPU's matmul rates (:meth:`rate`, GFLOP/s) and copy bandwidth (:meth:`stream_gbs`,
    GB/s), with the same methods as the CPU's ``PeakProbe`` so ``PeakMeter`` reads either.

    ``device`` must be a CUDA device unless a ``timer`` is given (tests on CPU tensors).
    Operands are made on first use of a kind and kept; the copy's destination is kept per
    source buffer."""

    kinds: tuple[str, ...] = (BF16_MATMUL, FP16_MATMUL, FP32_MATMUL)
    #: What :meth:`stream_gbs` measures (``bench decode`` reports it).
    stream_kind = "device-to-device copy (read + write)"

    def __init__(self, device: torch.device | str, *, matmul_n: int = MATMUL_N,
                 timer: Timer | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" and timer is None:
            raise ValueError(f"GpuPeakProbe: expected a CUDA device, got {self.device} "
                             "(pass timer= to run it elsewhere, as the tests do)")
        if matmul_n < 1:
            raise ValueError(f"GpuPeakProbe: matmul_n must be >= 1, got {matmul_n}")
        self.matmul_n = matmul_n
        self._timer = timer if timer is not None else _cuda_timer(self.device)
        self._operands: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._copies: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def matmul_call(self, kind: str) -> Callable[[], torch.Tensor]:
        """One ``n x n`` ``torch.mm`` of ``kind``'s dtype (TF32 off for fp32)."""
        if kind not in _DTYPES:
            raise ValueError(f"GPU peak: expected one of {list(self.kinds)}, got {kind!r}")
        with self._lock:
            if kind not in self._operands:
                gen = torch.Generator(device=self.device).manual_seed(0)
                shape = (self.matmul_n, self.matmul_n)
                self._operands[kind] = (
                    torch.randn(shape, generator=gen, device=self.device).to(_DTYPES[kind]),
                    torch.randn(shape, generator=gen, device=self.device).to(_DTYPES[kind]))
            a, b = self._operands[kind]

        def call() -> torch.Tensor:
            flags = torch.backends.cuda.matmul
            allow_tf32 = flags.allow_tf32
            flags.allow_tf32 = False
            try:
                return torch.mm(a, b)
            finally:
                flags.allow_tf32 = allow_tf32
        return call

    def rate(self, kind: str, threads: int | None = None, repeat: int = 3) -> float:
        """Best GFLOP/s of ``repeat`` matmuls of ``kind`` (``threads`` is the CPU probe's
        argument, ignored). ``ValueError`` for an unknown kind or a repeat below 1."""
        if repeat < 1:
            raise ValueError(f"GPU peak: expected repeat >= 1, got {repeat}")
        seconds = self._timer(self.matmul_call(kind), repeat)
        return 2.0 * self.matmul_n ** 3 / seconds / 1e9

    def stream_gbs(self, buffer: torch.Tensor, threads: int | None = None,
                   repeat: int = 1) -> float:
        """Best GB/s of ``repeat`` copies of ``buffer`` (contiguous, on this probe's device)
        into a buffer of its size: read plus write, ``2 * nbytes`` a copy. ``ValueError`` for
        another buffer or a repeat below 1."""
        if repeat < 1:
            raise ValueError(f"GPU stream: expected repeat >= 1, got {repeat}")
        if buffer.device != self.device or not buffer.is_contiguous() or buffer.numel() == 0:
            raise ValueError(f"GPU stream: expected a non-empty contiguous tensor on "
                             f"{self.device}, got {buffer.device} {tuple(buffer.shape)}")
        nbytes = buffer.numel() * buffer.element_size()
        key = (buffer.data_ptr(), nbytes)
        with self._lock:
            destination = self._copies.get(key)
            if destination is None:
                destination = self._copies[key] = torch.empty_like(buffer)
        seconds = self._timer(lambda: destination.copy_(buffer), repeat)
        return 2.0 * nbytes / seconds / 1e9
