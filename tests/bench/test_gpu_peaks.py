"""The GPU roofline of ``bench prefill`` / ``decode`` (issue 35), on CPU tensors with a fake
timer: what each kind multiplies, the FLOP and byte counts, and the rows and JSON the CUDA
branches produce. Nothing here runs on a GPU; the figures are what the arithmetic must give."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from app.bench import decode
from app.bench._decode_cases import Case, make_step
from app.bench._peaks import (
    BF16_MATMUL,
    FP16_MATMUL,
    FP32_MATMUL,
    GpuPeakProbe,
    PeakMeter,
    matmul_kind,
    peak_lines,
)

CPU = torch.device("cpu")


class FakeTimer:
    """Calls each function once (so its tensors are checked) and says it took ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.results: list[object] = []
        self.repeats: list[int] = []

    def __call__(self, fn: Callable[[], object], repeat: int) -> float:
        self.results.append(fn())
        self.repeats.append(repeat)
        return self.seconds


def test_matmul_kinds_follow_the_dtype() -> None:
    assert matmul_kind(torch.bfloat16) == BF16_MATMUL
    assert matmul_kind(torch.float16) == FP16_MATMUL
    assert matmul_kind(torch.float32) == FP32_MATMUL
    assert matmul_kind(torch.float8_e4m3fn) == FP32_MATMUL


def test_rates_are_two_n_cubed_over_the_best_time() -> None:
    timer = FakeTimer(0.002)
    probe = GpuPeakProbe(CPU, matmul_n=64, timer=timer)
    for kind, dtype in ((BF16_MATMUL, torch.bfloat16), (FP16_MATMUL, torch.float16),
                        (FP32_MATMUL, torch.float32)):
        assert probe.rate(kind, repeat=4) == pytest.approx(2 * 64 ** 3 / 0.002 / 1e9)
        product = timer.results[-1]
        assert isinstance(product, torch.Tensor) and product.dtype == dtype
        assert product.shape == (64, 64)
    assert timer.repeats == [4, 4, 4]


def test_the_fp32_matmul_runs_without_tf32() -> None:
    flags = torch.backends.cuda.matmul
    seen: list[bool] = []

    def timer(fn: Callable[[], object], repeat: int) -> float:
        real = torch.mm

        def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            seen.append(flags.allow_tf32)
            return real(a, b)

        torch.mm = spy  # type: ignore[assignment]
        try:
            fn()
        finally:
            torch.mm = real  # type: ignore[assignment]
        return 1.0

    before = flags.allow_tf32
    flags.allow_tf32 = True
    try:
        GpuPeakProbe(CPU, matmul_n=8, timer=timer).rate(FP32_MATMUL, repeat=1)
        assert seen == [False] and flags.allow_tf32 is True   # restored
    finally:
        flags.allow_tf32 = before


def test_the_copy_counts_read_and_write() -> None:
    timer = FakeTimer(0.001)
    probe = GpuPeakProbe(CPU, matmul_n=8, timer=timer)
    buffer = torch.arange(1 << 16, dtype=torch.float32)
    assert probe.stream_gbs(buffer, repeat=3) == pytest.approx(2 * (1 << 18) / 0.001 / 1e9)
    copy = timer.results[-1]
    assert isinstance(copy, torch.Tensor) and torch.equal(copy, buffer)
    assert copy.data_ptr() != buffer.data_ptr()
    probe.stream_gbs(buffer)
    assert timer.results[-1] is copy             # the destination is kept per buffer


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="expected a CUDA device"):
        GpuPeakProbe(CPU)
    probe = GpuPeakProbe(CPU, matmul_n=8, timer=FakeTimer(1.0))
    with pytest.raises(ValueError, match="expected one of"):
        probe.rate("fp32_fma")
    with pytest.raises(ValueError, match="repeat >= 1"):
        probe.rate(BF16_MATMUL, repeat=0)
    with pytest.raises(ValueError, match="non-empty contiguous tensor"):
        probe.stream_gbs(torch.ones(8, 8).t())
    with pytest.raises(ValueError, match="matmul_n must be >= 1"):
        GpuPeakProbe(CPU, matmul_n=0, timer=FakeTimer(1.0))


def _gpu_meter(matmul_seconds: float = 0.002) -> PeakMeter:
    return PeakMeter(CPU, probe=GpuPeakProbe(CPU, matmul_n=64, timer=FakeTimer(matmul_seconds)))


def test_a_gpu_meter_reads_each_row_against_its_dtypes_matmul() -> None:
    meter = _gpu_meter()
    assert meter.on_gpu and meter.bound_kind(torch.bfloat16, "fp32_fma") == BF16_MATMUL
    meter.sample(repeat=1)
    peak = 2 * 64 ** 3 / 0.002 / 1e9
    assert meter.best(BF16_MATMUL) == pytest.approx(peak)
    row: dict[str, object] = {}
    meter.annotate(row, BF16_MATMUL, flops=peak * 1e9 / 4, call_s=[1.0], peak_gflops=[peak])
    assert row["fraction_of_peak"] == 0.25 and row["fraction_of_peak_paired"] == 0.25
    summary = meter.summary()
    assert summary["kinds"] == dict.fromkeys((BF16_MATMUL, FP16_MATMUL, FP32_MATMUL),
                                             "measured")
    assert summary["bf16_matmul_gflops"] == round(peak, 1) and "cpu_model" not in summary
    lines = peak_lines(summary)
    assert lines[0].startswith("GPU peaks on cpu (64^3 matmuls): bf16_matmul ")
    assert "device-to-device copy" in lines[0]


def test_bench_decode_rows_on_a_gpu_meter() -> None:
    # The CUDA branch of a decode row: bound by the bf16 matmul, paired roofline from the
    # copy beside every call, the step's prepare_metadata timed apart from the runs.
    meter = _gpu_meter(matmul_seconds=1.0)        # 0.52 GFLOP/s: compute-bound on purpose
    stream = decode.StreamProbe(CPU, 1 / 1024, meter)
    assert stream.kind == "device-to-device copy (read + write)"
    case = Case("2x64", batch=2, context=64)
    from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend

    row = decode._run_case(TorchSDPADecodeBackend, case, "bf16", 16, CPU, 2, None, meter,
                           stream)
    assert row["bound_peak"] == BF16_MATMUL
    assert row["prepare_ms"] > 0 and row["prepare_ms_median"] >= row["prepare_ms"]
    assert row["roofline_fraction_paired"] is not None
    peak = 2 * 64 ** 3 / 1.0 / 1e9
    decode._rooflines([row], bw=1e3, mm=1.0, meter=meter)
    want = max(row["cache_mb"] * 1e6 / 1e12, row["gflop"] * 1e9 / (peak * 1e9))
    assert row["roofline_ms"] == round(want * 1e3, 3) and row["bound_by"] == "compute"
    assert "prep ms" in decode.render({
        "cpu": {"model": "m", "flags": []}, "torch": "t", "threads": 1, "device": "cuda",
        "load_average_1m": [0, 0], "stream_gbs": 1.0, "peaks": meter.summary(),
        "results": [row], "targets": [], "errors": []})


def test_flashinfer_mla_is_told_its_block_size_so_prepare_plans() -> None:
    from app.backends.decode.flashinfer_mla import FlashInferMLADecodeBackend

    step = make_step(Case("1x32", batch=1, context=32), 16, CPU, torch.bfloat16)
    seen: dict[str, object] = {}

    class Spy(FlashInferMLADecodeBackend):
        @functools.wraps(FlashInferMLADecodeBackend.__init__)   # its signature
        def __init__(self, *args: object, **kwargs: object) -> None:
            seen.update(kwargs)
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        decode._backend(Spy, Case("1x32", batch=1, context=32), step, CPU)
    assert seen["block_size"] == 16
