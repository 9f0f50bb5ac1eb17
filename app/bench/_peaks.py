"""This CPU's peak multiply-add rates, measured: the denominators of the CPU kernel benchmarks.

Why measured and not a matmul: on CPUs with AVX512-BF16 torch's float32 matmul is not the
machine's limit (it swung 65-209 GFLOP/s in one run on a 2-core EPYC where the native kernel
reached 329), so "fraction of the matmul rate" said little. A peak probe
(``app/backends/cpu/csrc/cpu_peaks.c``) runs a loop of independent multiply-adds held in
registers, one call on each of ``torch.get_num_threads()`` threads at once (the kernels'
threads), and reports the summed rate:

- ``fp32_fma``: ``vfmadd231ps`` on 512-bit vectors, 2 FLOPs a lane: the bound of a float32
  kernel (and of the native kernel's float32 math on bf16 inputs);
- ``bf16_dot``: ``vdpbf16ps``, two bf16 products accumulated in float32, 4 FLOPs a lane: the
  bound of a bf16 dot-product kernel (measured only where the CPU has AVX512-BF16);
- ``amx_bf16``: ``tdpbf16ps`` into 6 accumulator tiles (``cpu_peaks_amx.c``, guarded as the
  AMX kernel is: :mod:`app.backends.cpu.amx_probe`), where the CPU has AMX and Linux granted
  the tile state;
- ``bf16_matmul``: torch's own bf16 matmul (``torch.mm`` of 2048 x 2048 bf16 matrices, all of
  torch's threads: oneDNN, on AMX tiles where the CPU has them), reported beside the probes
  where the CPU has fast bf16 (a lower bound of what its fastest unit does).

**Each dtype is charged at the fastest unit the CPU offers for it** (:func:`fastest_unit`,
:meth:`PeakMeter.bound_kind`), whatever unit the kernel itself multiplies on (rows say that
apart, as ``kernel_unit``): a bf16 row at ``amx_bf16`` where the tiles were probed, at
``bf16_matmul`` on an AMX CPU whose tiles could not be probed, else at ``bf16_dot``, else at
``fp32_fma``; float32 and float16 rows at ``fp32_fma`` (no unit here multiplies them faster
with float32 sums; AMX-FP16 is not probed).
:meth:`PeakProbe.stream_gbs` reads a buffer far larger than the caches, a slice per thread:
the memory bound of ``bench decode``'s roofline.
The probe is built, cached and checked by the shared native loader
(:mod:`app.backends.cpu.loader`: private cache directories, ABI version).

On a CUDA device :class:`PeakMeter` reads the GPU's own peaks instead (:class:`GpuPeakProbe`:
bf16 / fp16 / fp32 matmul rates measured with torch, a device-to-device copy).
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch

from app._cpu import detect_cpu_features
from app.backends.cpu.amx_probe import AmxPeakProbe, amx_peak_probe_status, load_amx_peak_probe
from app.backends.cpu.loader import (
    NativeLibrary,
    NativeLibrarySpec,
    NativeLibraryStatus,
    load_native_library,
)
from app.bench._timing import time_calls

__all__ = [
    "AMX_BF16",
    "BF16_DOT",
    "BF16_MATMUL",
    "CPU_MATMUL_N",
    "CPU_UNITS",
    "FP16_MATMUL",
    "FP32_FMA",
    "FP32_MATMUL",
    "GPU_PEAK_BYTES",
    "MATMUL_N",
    "GpuPeakProbe",
    "PeakMeter",
    "PeakProbe",
    "PeakProbeStatus",
    "device_sync",
    "fastest_unit",
    "load_peak_probe",
    "matmul_call",
    "matmul_kind",
    "matmul_rate",
    "peak_kinds",
    "peak_lines",
    "peak_probe_status",
]

#: The peak kinds: float32 FMA, bf16 pair dot product into float32, AMX-BF16 tiles.
FP32_FMA = "fp32_fma"
BF16_DOT = "bf16_dot"
AMX_BF16 = "amx_bf16"
#: torch's bf16 matmul (on a CPU: oneDNN; on a GPU: the tensor cores).
BF16_MATMUL = "bf16_matmul"
#: The side of the CPU's bf16 matmul: 17 GFLOP a call.
CPU_MATMUL_N = 2048
#: The kinds a CPU may charge a dtype's work at (the fastest measured wins); others: fp32.
CPU_UNITS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: (AMX_BF16, BF16_MATMUL, BF16_DOT, FP32_FMA)}

#: ``APP_NATIVE_LIBRARY(...)`` in ``app/backends/cpu/csrc/cpu_peaks.c``.
ABI_VERSION = 2
#: Seconds one probe call aims for (one per thread; the best of ``repeat`` is kept).
PROBE_SECONDS = 0.03


@attrs.frozen
class PeakProbeStatus:
    """Whether the probes can run here; if not, every reason why."""

    available: bool
    reasons: tuple[str, ...] = ()


def fastest_unit(dtype: torch.dtype, runs: dict[str, list[float]], fallback: str,
                 amx_cpu: bool | None = None) -> str:
    """The fastest unit this CPU offers for ``dtype`` that ``runs`` measured: the first of
    :data:`CPU_UNITS` (else ``fp32_fma``) in the units' hardware order, AMX tiles, then
    bf16 dot products, then fp32 FMAs (by construction, not by which sample happened to be
    faster on a busy machine). torch's bf16 matmul counts only on a CPU with AMX (``amx_cpu``,
    default: its flags), standing in for tiles the probe could not run on; elsewhere it runs
    on the units the probes measure directly. ``fallback`` when none was measured."""
    amx_cpu = detect_cpu_features().amx_bf16 if amx_cpu is None else amx_cpu
    for kind in CPU_UNITS.get(dtype, (FP32_FMA,)):
        if runs.get(kind) and (kind != BF16_MATMUL or amx_cpu):
            return kind
    return fallback


class PeakProbe:
    """The loaded probe library: :meth:`rate` measures a peak in GFLOP/s (thread-safe).
    ``amx``: the AMX probe where it runs; ``bf16_matmul``: also measure torch's bf16 matmul
    (``matmul_n`` square)."""

    def __init__(self, library: ctypes.CDLL, has_bf16: bool, amx: AmxPeakProbe | None = None,
                 bf16_matmul: bool = False, matmul_n: int = CPU_MATMUL_N) -> None:
        self._fma = library.cpu_peak_fma_f32
        self._fma.restype = ctypes.c_float
        self._fma.argtypes = [ctypes.c_int64, ctypes.c_float, ctypes.c_float]
        flops = {FP32_FMA: library.cpu_peak_fma_f32_flops_per_iter}
        for fn in (library.cpu_peak_fma_f32_flops_per_iter,
                   library.cpu_peak_dot_bf16_flops_per_iter):
            fn.restype, fn.argtypes = ctypes.c_int64, []
        self._bf16 = None
        if has_bf16:
            self._bf16 = library.cpu_peak_dot_bf16
            self._bf16.restype = ctypes.c_float
            self._bf16.argtypes = [ctypes.c_int64, ctypes.c_uint32]
            flops[BF16_DOT] = library.cpu_peak_dot_bf16_flops_per_iter
        self._flops_per_iter = {kind: int(fn()) for kind, fn in flops.items()}
        self._amx = amx
        if amx is not None:
            self._flops_per_iter[AMX_BF16] = amx.flops_per_iter
        self._matmul_n = matmul_n
        self._matmul: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kinds = (*self._flops_per_iter, *((BF16_MATMUL,) if bf16_matmul else ()))
        self._stream = library.cpu_stream_read
        self._stream.restype = ctypes.c_int64
        self._stream.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self._iters: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def kinds(self) -> tuple[str, ...]:
        """The peaks this probe can measure on this CPU."""
        return self._kinds

    def _call(self, kind: str, iters: int) -> None:
        if kind == FP32_FMA:
            self._fma(iters, 1.0, 0.0)
        elif kind == AMX_BF16 and self._amx is not None:
            self._amx.call(iters)
        elif self._bf16 is not None:
            self._bf16(iters, 0x3F803F80)  # (1.0, 1.0) in bf16
        else:
            raise ValueError(f"peak probe: {kind!r} is not measurable on this CPU "
                             f"(measurable: {list(self.kinds)})")

    def _iterations(self, kind: str) -> int:
        with self._lock:
            iters = self._iters.get(kind)
        if iters is None:  # calibrate on one thread: iterations for PROBE_SECONDS
            n = 20_000
            self._call(kind, n)
            start = time.perf_counter()
            self._call(kind, n)
            per_iter = max(time.perf_counter() - start, 1e-9) / n
            iters = max(n, int(PROBE_SECONDS / per_iter))
            with self._lock:
                self._iters[kind] = iters
        return iters

    def rate(self, kind: str, threads: int | None = None, repeat: int = 3) -> float:
        """Best summed GFLOP/s of ``repeat`` rounds of one probe call on each of ``threads``
        threads at once (default ``torch.get_num_threads()``). ``ValueError`` for a kind this
        CPU cannot run, a thread count or repeat below 1."""
        if kind not in self.kinds:
            raise ValueError(f"peak probe: expected one of {list(self.kinds)}, got {kind!r}")
        workers = torch.get_num_threads() if threads is None else threads
        if workers < 1 or repeat < 1:
            raise ValueError(f"peak probe: expected threads >= 1 and repeat >= 1, got "
                             f"{workers} and {repeat}")
        if kind == BF16_MATMUL:
            return self._matmul_rate(repeat)
        iters = self._iterations(kind)
        best = float("inf")
        with ThreadPoolExecutor(workers, thread_name_prefix="app-peak-probe") as pool:
            for _ in range(repeat):
                start = time.perf_counter()
                for future in [pool.submit(self._call, kind, iters) for _ in range(workers)]:
                    future.result()
                best = min(best, time.perf_counter() - start)
        return workers * iters * self._flops_per_iter[kind] / best / 1e9


    def _matmul_rate(self, repeat: int) -> float:
        """Best GFLOP/s of ``repeat`` bf16 ``torch.mm`` calls (torch's threads), after one."""
        with self._lock:
            if self._matmul is None:
                gen = torch.Generator().manual_seed(0)
                shape = (self._matmul_n, self._matmul_n)
                self._matmul = (torch.randn(shape, generator=gen).bfloat16(),
                                torch.randn(shape, generator=gen).bfloat16())
            a, b = self._matmul
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return 2.0 * self._matmul_n ** 3 / best / 1e9

    def stream_gbs(self, buffer: torch.Tensor, threads: int | None = None,
                   repeat: int = 1) -> float:
        """Best GB/s of ``repeat`` reads of ``buffer`` (a contiguous CPU tensor, 64-byte
        aligned; far larger than the caches), a slice per thread on ``threads`` threads at
        once (default ``torch.get_num_threads()``): this package's threads, not OpenMP's,
        whose spinning after a region would slow what is timed next. ``ValueError`` for a
        buffer that is not so, a thread count or repeat below 1."""
        workers = torch.get_num_threads() if threads is None else threads
        if workers < 1 or repeat < 1:
            raise ValueError(f"stream probe: expected threads >= 1 and repeat >= 1, got "
                             f"{workers} and {repeat}")
        nbytes = buffer.numel() * buffer.element_size()
        share = nbytes // workers // 256 * 256
        if buffer.device.type != "cpu" or not buffer.is_contiguous() \
                or buffer.data_ptr() % 64 or share == 0:
            raise ValueError(f"stream probe: expected a contiguous, 64-byte aligned CPU tensor "
                             f"of at least {256 * workers} bytes, got {buffer.device} "
                             f"{tuple(buffer.shape)} at {buffer.data_ptr():#x}")
        base = buffer.data_ptr()
        best = float("inf")
        with ThreadPoolExecutor(workers, thread_name_prefix="app-stream-probe") as pool:
            for _ in range(repeat):
                start = time.perf_counter()
                for future in [pool.submit(self._stream, base + w * share, share)
                               for w in range(workers)]:
                    future.result()
                best = min(best, time.perf_counter() - start)
        return share * workers / best / 1e9


def _requirements() -> list[str]:
    if not detect_cpu_features().avx512f:
        return ["needs a CPU with AVX-512 (avx512f), this one has none"]
    return []


def _requirements_bf16() -> list[str]:
    reasons = _requirements()
    if not detect_cpu_features().avx512_bf16:
        reasons.append("needs a CPU with AVX512-BF16 for the bf16 probe")
    return reasons


#: The probe library with the bf16 loop (CPUs with AVX512-BF16), and without it (the rest,
#: or a compiler that does not know ``avx512bf16``).
SPEC_BF16 = NativeLibrarySpec(name="cpu_peaks", sources=("cpu_peaks.c",),
                              abi_version=ABI_VERSION, flags=("-O2", "-mavx512f", "-mfma"),
                              link_flags=(), requirements=_requirements_bf16)
SPEC_FP32 = NativeLibrarySpec(name="cpu_peaks_fp32", sources=("cpu_peaks.c",),
                              abi_version=ABI_VERSION,
                              flags=("-O2", "-mavx512f", "-mfma", "-DAPP_NO_AVX512BF16"),
                              link_flags=(), requirements=_requirements)
_probe_lock = threading.Lock()
_probe: list[tuple[NativeLibrary, PeakProbe]] = []


def _status() -> NativeLibraryStatus:
    status = load_native_library(SPEC_BF16)
    return status if status.available else load_native_library(SPEC_FP32)


def load_peak_probe() -> PeakProbe | None:
    """The probe, built on the first call in a process by the shared native loader; None
    where it cannot be (:func:`peak_probe_status` says why)."""
    library = _status().library
    if library is None:
        return None
    with _probe_lock:
        if not _probe or _probe[0][0] is not library:
            has_bf16 = bool(library.function("cpu_peak_has_bf16_probe", ctypes.c_int32)())
            _probe[:] = [(library, PeakProbe(library.cdll, has_bf16, load_amx_peak_probe(),
                                             detect_cpu_features().fast_bfloat16))]
        return _probe[0][1]


def peak_probe_status() -> PeakProbeStatus:
    """Whether :func:`load_peak_probe` gives a probe, and if not why."""
    status = _status()
    return PeakProbeStatus(status.available, status.reasons)


def peak_kinds() -> dict[str, str]:
    """Every peak kind -> ``"measured"`` or why it is not measured on this machine."""
    probe = load_peak_probe()
    status = peak_probe_status()
    why = "; ".join(status.reasons)
    result = {FP32_FMA: "measured" if probe is not None else why}
    if probe is None:
        result[BF16_DOT] = why
    elif BF16_DOT in probe.kinds:
        result[BF16_DOT] = "measured"
    else:
        result[BF16_DOT] = "this CPU has no AVX512-BF16 (or the compiler does not know it)"
    result[AMX_BF16] = ("measured" if probe is not None and AMX_BF16 in probe.kinds
                        else amx_peak_probe_status()[1])
    result[BF16_MATMUL] = ("measured" if probe is not None and BF16_MATMUL in probe.kinds
                           else "this CPU has no fast bf16 (AVX512-BF16 or AMX): not measured")
    return result


# -- a CUDA GPU's peaks, measured with torch ----------------------------------------------
#
# - ``bf16_matmul``, ``fp16_matmul``, ``fp32_matmul``: ``torch.mm`` of ``n x n`` matrices of
#   that dtype (fp32 with TF32 off), ``2 n^3`` FLOPs a call: the compute bound of a kernel that
#   multiplies in that dtype (a bf16 attention kernel runs q.k and p.v on the bf16 tensor
#   cores). Before issue 35 the GPU rows were read against an fp32 matmul (47 TFLOP/s on the
#   H100, where its bf16 matmul is an order of magnitude faster) and against no peak at all.
# - the memory bandwidth: a device-to-device copy of a buffer far larger than the L2 cache,
#   counted as read plus write (twice the buffer's bytes a call): the bound of a memory-bound
#   kernel (decode reads its cache once).
#
# Each is the best of ``repeat`` calls, each between two synchronisations (``time_calls``). The
# timer is a parameter so that the arithmetic and the tensors each kind uses are tested on a
# CPU machine (tests/bench/test_gpu_peaks.py); none of it has run on a GPU yet.

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


class PeakMeter:
    """The peaks of one benchmark run, for the rows it reports: the CPU's probe on the CPU,
    the GPU's matmul rates and copy bandwidth on CUDA (``GpuPeakProbe``), a no-op elsewhere.

    :meth:`sample` measures every kind (call it at the start and the end of a run);
    :meth:`beside` gives a function for ``time_interleaved`` that measures one kind beside
    every timed call; :meth:`annotate` adds a row's fractions of the peak that bounds it:
    ``fraction_of_peak`` (best call over the best peak of the run) and
    ``fraction_of_peak_paired`` (median over rounds of the call's rate over the peak measured
    right after it: the figure targets read, as it shares the shared machine's slow spells).
    """

    def __init__(self, device: torch.device,
                 probe: PeakProbe | GpuPeakProbe | None = None) -> None:
        if probe is None and device.type == "cpu":
            probe = load_peak_probe()
        elif probe is None and device.type == "cuda":
            probe = GpuPeakProbe(device)
        self.probe = probe
        self.enabled = probe is not None
        self.runs: dict[str, list[float]] = {}
        self._paired: dict[int, list[float]] = {}

    @property
    def on_gpu(self) -> bool:
        """Whether this run reads a GPU's peaks (``GpuPeakProbe``)."""
        return isinstance(self.probe, GpuPeakProbe)

    def bound_kind(self, dtype: torch.dtype, cpu_kind: str) -> str:
        """The peak a row of ``dtype`` inputs is read against: on a GPU the matmul rate of
        the dtype it multiplies in (``matmul_kind``); on the CPU the fastest unit measured
        for ``dtype`` so far (:func:`fastest_unit`; ``cpu_kind``, the kernel's own unit,
        before anything is measured)."""
        if self.on_gpu:
            return matmul_kind(dtype)
        return fastest_unit(dtype, self.runs, cpu_kind)

    def sample(self, repeat: int = 3) -> None:
        """Measure every kind this CPU has once more (best of ``repeat``)."""
        if self.probe is None or not self.enabled:
            return
        for kind in self.probe.kinds:
            self.runs.setdefault(kind, []).append(self.probe.rate(kind, repeat=repeat))

    def beside(self, kind: str, into: list[float]) -> Callable[[], None]:
        """A function that measures ``kind`` (best of 2) and appends the GFLOP/s to ``into``."""
        probe = self.probe

        def measure() -> None:
            if probe is not None and self.enabled:
                rate = probe.rate(kind, repeat=2)
                into.append(rate)
                self.runs.setdefault(kind, []).append(rate)
        return measure

    def best(self, kind: str) -> float | None:
        """The best rate of ``kind`` seen in this run (None if never measured)."""
        runs = self.runs.get(kind)
        return max(runs) if runs else None

    def annotate(self, row: dict[str, Any], kind: str, flops: float, call_s: list[float],
                 peak_gflops: list[float]) -> None:
        """Add ``bound_peak``, ``peak_gflops``, ``fraction_of_peak`` and
        ``fraction_of_peak_paired`` to ``row`` (None where nothing was measured)."""
        row["bound_peak"] = kind
        best = self.best(kind)
        row["peak_gflops"] = None if best is None else round(best, 1)
        row["fraction_of_peak"] = (None if best is None
                                   else round(flops / min(call_s) / 1e9 / best, 3))
        pairs = list(zip(call_s, peak_gflops[-len(call_s):], strict=False))
        row["fraction_of_peak_paired"] = (round(statistics.median(
            flops / t / 1e9 / peak for t, peak in pairs), 3) if len(pairs) == len(call_s)
            and pairs else None)

    def finish(self, rows: list[dict[str, Any]]) -> None:
        """Re-read each row's best-over-best fraction against the best peak of the whole run."""
        for row in rows:
            best = self.best(str(row.get("bound_peak")))
            if best is not None and row.get("gflops"):
                row["peak_gflops"] = round(best, 1)
                row["fraction_of_peak"] = round(row["gflops"] / best, 3)

    def summary(self) -> dict[str, Any]:
        """JSON: the CPU (model and flags), threads, each kind's best and samples, and why any
        kind is not measured; on a GPU, the device and each kind's best and samples."""
        if isinstance(self.probe, GpuPeakProbe):
            return {"device": str(self.probe.device), "matmul_n": self.probe.matmul_n,
                    "kinds": dict.fromkeys(self.probe.kinds, "measured"),
                    "stream": self.probe.stream_kind,
                    **{f"{kind}_gflops": round(max(runs), 1)
                       for kind, runs in self.runs.items()},
                    "samples": {kind: [round(x, 1) for x in runs]
                                for kind, runs in self.runs.items()}}
        features = detect_cpu_features()
        return {"cpu_model": features.model_name, "cpu_features": features.present(),
                "threads": torch.get_num_threads(),
                "kinds": peak_kinds() if self.enabled or self.probe is None else {},
                **{f"{kind}_gflops": round(max(runs), 1) for kind, runs in self.runs.items()},
                "samples": {kind: [round(x, 1) for x in runs] for kind, runs in self.runs.items()}}


def peak_lines(peaks: dict[str, Any] | None) -> list[str]:
    """The readable lines of a ``PeakMeter.summary`` (none for None)."""
    if not peaks:
        return []
    rates = ", ".join(f"{kind} {peaks[f'{kind}_gflops']} GFLOP/s (samples {samples})"
                      for kind, samples in peaks["samples"].items())
    if "cpu_model" not in peaks:  # a GPU's
        return [f"GPU peaks on {peaks['device']} ({peaks['matmul_n']}^3 matmuls): "
                f"{rates or 'none measured'}; memory bound: {peaks['stream']}",
                "target measure: fraction of the bounding peak, paired (x matmul: fp32, "
                "kept beside it)"]
    missing = "; ".join(f"{kind}: {why}" for kind, why in peaks["kinds"].items()
                        if why != "measured")
    return [f"CPU {peaks['cpu_model']} [{' '.join(peaks['cpu_features'])}], "
            f"{peaks['threads']} threads; peaks: {rates or 'none measured'}"
            + (f"; not measured: {missing}" if missing else ""),
            "target measure: fraction of the bounding peak, paired (x matmul kept beside it)"]


def device_sync(device: torch.device) -> Callable[[], None]:
    """What to run before each clock read on ``device`` (CUDA's synchronize; nothing on a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def matmul_call(device: torch.device, n: int = CPU_MATMUL_N) -> Callable[[], object]:
    """One float32 ``torch.mm`` of ``n x n`` matrices per call (TF32 off on CUDA)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def call() -> object:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return torch.mm(a, b)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return call


def matmul_rate(device: torch.device, n: int = CPU_MATMUL_N, repeat: int = 10) -> float:
    """Best float32 ``torch.mm`` GFLOP/s on ``n x n`` matrices (TF32 off on CUDA)."""
    best = time_calls(matmul_call(device, n), repeat=repeat, sync=device_sync(device))["min_s"]
    return 2.0 * n ** 3 / best / 1e9
