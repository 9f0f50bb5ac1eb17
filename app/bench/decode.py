"""``python -m app bench decode``: MLA decode backends over a paged latent cache, with targets.

Cases (bf16 cache, 16 heads unless said, ``kv_lora_rank`` 512, rope 64, block size 64 or
``--block-size``): ``1x32k`` (batch 1, 32k-token context), ``16x8k``, ``64x4k``, ``64x4k q4``
(query_len 4, causal: multi-token prediction), ``16x8k h128`` (128 heads). Pages are handed out
in a random order. Every backend valid here runs each case, interleaved round by round with
TORCH_SDPA (the baseline) so a slow spell of a shared machine hits both.

Per case: ms (best and median), cache GB/s (the cache bytes the step reads:
``sum(seq_len) * (kv_lora_rank + rope) * element size``), GFLOP/s (``2 * (2 * kv_lora_rank +
rope) * H`` per (query row, visible key): q.k over the whole row and p.v over the latent),
the fraction of the CPU peak that bounds the kernel, measured beside every call
(``bound_peak``: ``bf16_dot`` where CPU_MLA runs on bf16 dot products, else ``fp32_fma``;
``fraction_of_peak``, ``fraction_of_peak_paired``; ``app.bench._peaks``) and the roofline
with that peak as the compute bound (``peak_roofline_fraction``), and the **roofline
fraction**: lower bound = max(cache bytes / stream bandwidth, FLOPs / compute rate),
fraction = lower bound / best time. Both rates are measured in the same run:
the stream bandwidth is the best ``sum()`` over a float32 tensor of ``--stream-gib`` GiB
(>= 1), the compute rate the float32 ``torch.mm`` 2048^3 rate the prefill benchmark uses; each
is measured at the start, before every case and at the end, and the best of each is used (a
low reading would flatter the fraction). Peak extra memory per call: the growth of the
process's peak RSS during one untimed call (``VmHWM`` reset through ``/proc/self/clear_refs``
after ``malloc_trim``), on top of what was resident before it; ``None`` where that cannot be
read. CPU_MLA's per-thread scratch is reported beside it (kept between calls).

Targets (issue 14, CPU): CPU_MLA >= 0.7 of the roofline on ``16x8k`` and ``64x4k``, and >= 5x
TORCH_SDPA on every case; pass/fail in ``targets`` (a missed target does not fail the
command; ``ok`` is False only when something errored). ``--quick`` shrinks everything for
tests (and reports no targets). The 1-minute load average before and after is reported: on
a busy machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import math
import os
import platform as _pyplatform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from app._imports import import_object
from app._types import DeviceCapability
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.table import DECODE_BACKENDS as DECODE_BACKEND_TABLE
from app.bench._peaks import BF16_DOT, FP32_FMA, PeakMeter
from app.bench._timing import time_calls, time_interleaved
from app.bench.prefill import matmul_rate
from app.commands._args import bench_device, buffer_gib, positive_int, resolve_device
from app.commands._memory import check_host_memory

HELP = "MLA decode backends over a paged cache: ms, GB/s, GFLOP/s, roofline fraction"

TARGET_ROOFLINE = 0.7
TARGET_ROOFLINE_CASES = ("16x8k", "64x4k")
TARGET_SPEEDUP = 5.0
BASELINE = "TORCH_SDPA"
RANK, ROPE = 512, 64
#: The built-in decode backends (imported lazily; a missing package skips one).
DECODE_BACKENDS: dict[str, str] = DECODE_BACKEND_TABLE.as_dict()


@attrs.frozen
class Case:
    """One decode step: ``batch`` requests of ``context`` tokens (incl. the new ones)."""

    name: str
    batch: int
    context: int
    heads: int = 16
    query_len: int = 1

    def flops(self) -> float:
        """``2 * (2 * rank + rope) * H`` per (query row, visible key), causal in the step."""
        seen = sum(self.context - self.query_len + i + 1 for i in range(self.query_len))
        return 2.0 * (2 * RANK + ROPE) * self.heads * self.batch * seen

    def cache_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of cache the step reads (every request's rows once)."""
        return self.batch * self.context * (RANK + ROPE) * dtype.itemsize


def default_cases(quick: bool) -> list[Case]:
    """The issue's cases, or small ones with ``quick``."""
    if quick:
        return [Case("1x2k", 1, 2048), Case("4x512", 4, 512), Case("4x512 q4", 4, 512,
                                                                     query_len=4)]
    return [Case("1x32k", 1, 32768), Case("16x8k", 16, 8192), Case("64x4k", 64, 4096),
            Case("64x4k q4", 64, 4096, query_len=4), Case("16x8k h128", 16, 8192, heads=128)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--device``, ``--backends``, ``--block-size``, ``--repeat`` ..."""
    parser.add_argument("--quick", action="store_true", help="small shapes, for tests")
    parser.add_argument("--device", default=None, type=bench_device,
                        help="cpu, cuda or cuda:N (default: cuda if present)")
    parser.add_argument("--backends", default="valid",
                        help="comma list of decode backend names, or 'valid'")
    parser.add_argument("--block-size", type=positive_int, default=64, help="cache block size (64)")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="timed calls per case (default 5, 2 with --quick)")
    parser.add_argument("--stream-gib", type=buffer_gib, default=None,
                        help="GiB read to measure the stream bandwidth (default 1; 0.0625 quick)")
    parser.add_argument("--no-baseline", action="store_true",
                        help=f"do not time {BASELINE} beside each backend")


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def stream_bandwidth(device: torch.device, gib: float, repeat: int = 5) -> float:
    """Best GB/s of ``sum()`` over a float32 tensor of ``gib`` GiB (a streaming read)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)
    best = time_calls(x.sum, repeat=repeat, sync=_sync(device))["min_s"]
    return x.numel() * 4 / best / 1e9


def check_bench_memory(device: torch.device, cases: list[Case], block_size: int,
                       stream_gib: float) -> None:
    """``ValueError`` before anything is allocated when the largest case's cache (made in
    float32 on the host, then bf16 on ``device``; a huge ``--block-size`` pads every request
    to a whole block) and the stream buffer cannot fit in memory."""
    rows = max(c.batch * -(-c.context // block_size) * block_size for c in cases)
    cache = rows * (RANK + ROPE)
    stream = int(stream_gib * 2**30)
    what = f"bench decode with --block-size {block_size} and --stream-gib {stream_gib}"
    if device.type == "cuda":
        check_host_memory(what, cache * 4)
        free, _ = torch.cuda.mem_get_info(device)
        if cache * 2 + stream > free:
            raise ValueError(f"{what} needs {(cache * 2 + stream) / 2**30:.1f} GiB on {device}; "
                             f"it has {free / 2**30:.1f} GiB free")
    else:
        check_host_memory(what, cache * 6 + stream)


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


@attrs.frozen
class _Step:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor
    cache: torch.Tensor


def _step(case: Case, block_size: int, device: torch.device) -> _Step:
    gen = torch.Generator().manual_seed(0)
    per = -(-case.context // block_size)
    blocks = case.batch * per
    table = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(case.batch, per)
    cache = torch.randn(blocks, block_size, RANK + ROPE, generator=gen).to(device,
                                                                           torch.bfloat16)
    q = torch.randn(case.batch, case.query_len, case.heads, RANK + ROPE,
                    generator=gen).to(device, torch.bfloat16)
    return _Step(table.to(device), torch.full((case.batch,), case.context, dtype=torch.int32,
                                              device=device), q, cache)


def _backend(cls: type[MLADecodeBackend], case: Case, step: _Step,
             device: torch.device) -> MLADecodeBackend:
    be = cls(num_heads=case.heads, scale=1 / math.sqrt(192), kv_lora_rank=RANK,
             qk_rope_head_dim=ROPE, kv_cache_dtype=torch.bfloat16,
             device_capability=_capability(device))
    be.prepare_metadata(step.block_table, step.seq_lens, case.query_len)
    return be


_libc: Any = None


def _malloc_trim() -> None:
    global _libc
    with contextlib.suppress(OSError, AttributeError):
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"))
        _libc.malloc_trim(0)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """How far one call of ``fn`` raises the peak memory above what was in use before it:
    CUDA ``max_memory_allocated``; on the CPU, the peak RSS (``VmHWM``, reset first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    _malloc_trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    if rss is None or peak is None:
        return None
    return max(0, peak - rss) * 1024


def _scratch_bytes(cls: type[MLADecodeBackend], case: Case) -> int | None:
    if cls.get_name() != "CPU_MLA":
        return None
    from app.backends.decode.cpu_mla import load_decode_kernel

    kernel = load_decode_kernel()
    if kernel is None:
        return None
    floats = int(kernel._scratch_floats(case.query_len, case.heads, RANK, ROPE))
    return floats * 4 * torch.get_num_threads()


def _run_case(cls: type[MLADecodeBackend], case: Case, block_size: int, device: torch.device,
              repeat: int, baseline: type[MLADecodeBackend] | None,
              meter: PeakMeter | None = None) -> dict[str, Any]:
    step = _step(case, block_size, device)
    be = _backend(cls, case, step, device)
    fns: dict[str, Callable[[], object]] = {
        "backend": lambda: be.run_decode(step.q, step.cache, return_softmax_lse=True)}
    base = None
    if baseline is not None and baseline is not cls:
        base = _backend(baseline, case, step, device)
        fns["baseline"] = lambda: base.run_decode(step.q, step.cache, return_softmax_lse=True)
    # The peak that bounds the kernel, beside every call: bf16 dot products where CPU_MLA
    # runs the bench's bf16 cache on them, else the fp32 FMA peak (float32 math).
    peak_kind = BF16_DOT if cls.get_name() == "CPU_MLA" and _bf16_dot() else FP32_FMA
    peak_s: list[float] = []
    if meter is not None and meter.enabled:
        fns["peak"] = meter.beside(peak_kind, peak_s)
    timed = time_interleaved(fns, repeat=repeat, sync=_sync(device))
    t = min(timed["backend"])
    row: dict[str, Any] = {
        "backend": cls.get_name(), "case": case.name, "batch": case.batch,
        "context": case.context, "heads": case.heads, "query_len": case.query_len,
        "block_size": block_size, "gflop": round(case.flops() / 1e9, 3),
        "cache_mb": round(case.cache_bytes(torch.bfloat16) / 1e6, 1),
        "ms": round(t * 1e3, 3), "ms_median": round(statistics.median(timed["backend"]) * 1e3, 3),
        "gflops": round(case.flops() / t / 1e9, 1),
        "cache_gbs": round(case.cache_bytes(torch.bfloat16) / t / 1e9, 2),
        "peak_extra_mb": _mb(peak_extra_bytes(fns["backend"], device)),
        "scratch_mb": _mb(_scratch_bytes(cls, case))}
    if meter is not None and meter.enabled:
        meter.annotate(row, peak_kind, case.flops(), timed["backend"], peak_s)
    if base is not None:
        tb = min(timed["baseline"])
        row.update({"baseline": baseline.get_name() if baseline else None,
                    "baseline_ms": round(tb * 1e3, 3), "speedup_vs_baseline": round(tb / t, 2),
                    "baseline_peak_extra_mb": _mb(peak_extra_bytes(fns["baseline"], device))})
    return row


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 1e6, 1)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for row in rows:
        if row["backend"] != "CPU_MLA":
            continue
        if row["case"] in TARGET_ROOFLINE_CASES:
            value = row["roofline_fraction"]
            targets.append({"name": f"CPU_MLA {row['case']} roofline fraction", "value": value,
                            "target": TARGET_ROOFLINE, "pass": value >= TARGET_ROOFLINE})
        if "speedup_vs_baseline" in row:
            value = row["speedup_vs_baseline"]
            targets.append({"name": f"CPU_MLA {row['case']} speed-up over {BASELINE}",
                            "value": value, "target": TARGET_SPEEDUP,
                            "pass": value >= TARGET_SPEEDUP})
    return targets


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result."""
    started = time.perf_counter()
    device = resolve_device(args.device)
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    gib = args.stream_gib if args.stream_gib is not None else (0.0625 if args.quick else 1.0)
    if not gib > 0:
        raise ValueError(f"--stream-gib must be > 0, got {gib}")
    check_bench_memory(device, default_cases(args.quick), args.block_size, gib)
    repeat = args.repeat or (2 if args.quick else 5)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    classes, skipped = _backend_classes(args.backends, device)
    baseline = None
    if not args.no_baseline:
        base_classes, _ = _backend_classes(BASELINE, device)
        baseline = base_classes[0] if base_classes else None
    mm_n, mm_rep = (256, 3) if args.quick else (2048, 5)
    meter = PeakMeter(device)
    meter.sample(repeat=1 if args.quick else 3)
    mm_runs = [matmul_rate(device, mm_n, mm_rep)]
    bw_runs = [stream_bandwidth(device, gib)]
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for case in default_cases(args.quick):
        for cls in classes:
            if cls is baseline and len(classes) > 1:
                continue  # timed beside every other backend
            if not args.quick:
                mm_runs.append(matmul_rate(device, mm_n, 3))
                bw_runs.append(stream_bandwidth(device, gib, 3))
            try:
                rows.append(_run_case(cls, case, args.block_size, device, repeat, baseline,
                                      meter))
            except (RuntimeError, ValueError) as exc:
                errors.append(f"{cls.get_name()} {case.name}: {exc}")
    mm_runs.append(matmul_rate(device, mm_n, mm_rep))
    bw_runs.append(stream_bandwidth(device, gib))
    meter.sample(repeat=1 if args.quick else 3)
    meter.finish(rows)
    mm, bw = max(mm_runs), max(bw_runs)
    for row in rows:
        case_bytes, flops, t = row["cache_mb"] * 1e6, row["gflop"] * 1e9, row["ms"] / 1e3
        bound = max(case_bytes / (bw * 1e9), flops / (mm * 1e9))
        row["roofline_ms"] = round(bound * 1e3, 3)
        row["bound_by"] = "memory" if case_bytes / bw > flops / mm else "compute"
        row["roofline_fraction"] = round(bound / t, 3)
        if "baseline_ms" in row:
            row["baseline_roofline_fraction"] = round(bound / (row["baseline_ms"] / 1e3), 4)
        if row.get("peak_gflops"):  # the roofline with the measured FMA peak as compute bound
            row["peak_roofline_fraction"] = round(max(
                case_bytes / (bw * 1e9), flops / (row["peak_gflops"] * 1e9)) / t, 3)
    targets = _targets(rows) if device.type == "cpu" and not args.quick else []
    return {
        "benchmark": "decode", "device": str(device), "cpu": _cpu(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "python": _pyplatform.python_version(),
        "quick": bool(args.quick), "cache_dtype": "bfloat16", "kv_lora_rank": RANK,
        "qk_rope_head_dim": ROPE, "block_size": args.block_size,
        "stream_gbs": round(bw, 2), "stream_gbs_runs": [round(x, 2) for x in bw_runs],
        "stream_gib": gib, "matmul_fp32_gflops": round(mm, 1),
        "matmul_fp32_gflops_runs": [round(x, 1) for x in mm_runs],
        "load_average_1m": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg")
                            else None],
        "peaks": meter.summary() if device.type == "cpu" else None,
        "cpu_mla_bf16_dot": _bf16_dot(), "results": rows, "skipped_backends": skipped,
        "targets": targets,
        "targets_met": all(t["pass"] for t in targets) if targets else None,
        "errors": errors, "ok": not errors, "elapsed_s": round(time.perf_counter() - started, 1)}


def render(result: dict[str, Any]) -> str:
    """A readable table of the results and the targets."""
    cpu = result["cpu"]
    lines = [f"decode benchmark on {result['device']} ({cpu['model']}; "
             f"{' '.join(cpu['flags'])}), torch {result['torch']}, {result['threads']} "
             f"threads, load average {result['load_average_1m']}; stream "
             f"{result['stream_gbs']} GB/s, fp32 matmul {result['matmul_fp32_gflops']} GFLOP/s",
             f"{'backend':14s} {'case':12s} {'ms':>9s} {'median':>9s} {'GB/s':>7s} "
             f"{'GFLOP/s':>8s} {'roofline':>8s} {'peak MB':>8s} {BASELINE + ' ms':>14s} "
             f"{'speed-up':>8s}"]
    for r in result["results"]:
        lines.append(f"{r['backend']:14s} {r['case']:12s} {r['ms']:9.2f} {r['ms_median']:9.2f} "
                     f"{r['cache_gbs']:7.2f} {r['gflops']:8.1f} {r['roofline_fraction']:8.3f} "
                     f"{_fmt(r['peak_extra_mb']):>8s} {_fmt(r.get('baseline_ms')):>14s} "
                     f"{_fmt(r.get('speedup_vs_baseline')):>8s}")
    for t in result["targets"]:
        lines.append(f"target: {t['name']}: {t['value']} vs >= {t['target']}: "
                     f"{'pass' if t['pass'] else 'MISS'}")
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value}"
