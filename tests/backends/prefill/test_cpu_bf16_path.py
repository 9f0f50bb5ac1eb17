"""Which kernel TORCH_SDPA runs bf16 prefill on (``app.backends.prefill.cpu_bf16_path``): chosen
by measured speed on AMX CPUs (faked here with a timer), measured once per machine and kept
beside the library so every process takes the same; native without measuring elsewhere and
with ``APP_CPU_AMX=0``; forced by ``APP_CPU_PREFILL_PATH``; aten's bf16 in float32 with
``APP_CPU_AMX=0``; the text says what runs on the CPU it runs on; and both paths are correct on
any CPU, so whichever the measurement picks on an AMX machine computes the same attention."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.backends.prefill import cpu_bf16_path, torch_sdpa
from app.backends.prefill.cpu_bf16_path import (
    ATEN,
    NATIVE,
    CalibrationFile,
    choose_bf16_prefill_path,
    reset_bf16_prefill_path,
)
from app.backends.prefill.metadata import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend, aten_cpu_path
from app.testing import assert_conformance
from tests.backends.cpu._fake_cpu import (  # noqa: F401 - the fixture
    AVX2_ONLY,
    SAPPHIRE_RAPIDS,
    ZEN4,
    FakeCpu,
    fake_cpu,
)

BOTH = {NATIVE: None, ATEN: None}


class Clock:
    """A timer that says ``seconds[path]`` and records what it was asked."""

    def __init__(self, native: float, aten: float) -> None:
        self.seconds, self.calls = {NATIVE: native, ATEN: aten}, []

    def __call__(self, path: str) -> float:
        self.calls.append(path)
        return self.seconds[path]


@pytest.fixture(autouse=True)
def _fresh_choice() -> Iterator[None]:
    reset_bf16_prefill_path()
    yield
    reset_bf16_prefill_path()


@pytest.mark.parametrize(("native", "aten", "chosen"), [(2.0, 1.0, ATEN), (1.0, 3.0, NATIVE)])
def test_on_an_amx_cpu_the_faster_path_is_measured_and_taken(native: float, aten: float,
                                                              chosen: str) -> None:
    clock = Clock(native, aten)
    choice = choose_bf16_prefill_path("auto", amx_cpu=True, runnable=BOTH, timer=clock)
    assert choice.path == chosen and choice.seconds == {NATIVE: native, ATEN: aten}
    assert "measured faster (AMX tiles present" in choice.reason
    assert f"native {native * 1e3:.2f} ms, aten {aten * 1e3:.2f} ms" in choice.reason
    assert clock.calls == [NATIVE, ATEN] * 4      # a warm-up and three interleaved rounds


def test_without_amx_native_is_taken_unmeasured_unless_asked() -> None:
    clock = Clock(2.0, 1.0)
    choice = choose_bf16_prefill_path("auto", amx_cpu=False, runnable=BOTH, timer=clock)
    assert choice.path == NATIVE and clock.calls == [] and "not measured" in choice.reason
    measured = choose_bf16_prefill_path("measure", amx_cpu=False, runnable=BOTH, timer=clock)
    assert measured.path == ATEN and "APP_CPU_PREFILL_PATH=measure" in measured.reason


def test_a_forced_or_only_path_is_taken_without_measuring() -> None:
    clock = Clock(1.0, 2.0)
    assert choose_bf16_prefill_path(ATEN, True, BOTH, clock).path == ATEN
    broken = {NATIVE: "no C compiler", ATEN: None}
    forced = choose_bf16_prefill_path(NATIVE, True, broken, clock)
    assert forced.path == ATEN and "cannot run here (no C compiler)" in forced.reason
    only = choose_bf16_prefill_path("auto", True, broken, clock)
    assert only.path == ATEN and "the only path here" in only.reason
    assert clock.calls == []


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_CPU_PREFILL_PATH", "fastest")
    with pytest.raises(ValueError, match="APP_CPU_PREFILL_PATH: expected one of auto, measure"):
        cpu_bf16_path.read_path_setting()
    monkeypatch.setenv("APP_CPU_PREFILL_PATH", " ATEN ")
    assert cpu_bf16_path.read_path_setting() == ATEN


def test_the_choice_is_made_once_per_process_and_setting(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    clock = Clock(2.0, 1.0)
    first = cpu_bf16_path.bf16_prefill_path(True, BOTH, clock)
    assert cpu_bf16_path.bf16_prefill_path(True, BOTH, clock) is first
    assert len(clock.calls) == 8
    monkeypatch.setenv("APP_CPU_PREFILL_PATH", NATIVE)
    assert cpu_bf16_path.bf16_prefill_path(True, BOTH, clock).path == NATIVE


def test_torch_sdpa_follows_the_choice_and_both_paths_conform(
        monkeypatch: pytest.MonkeyPatch, fake_cpu: FakeCpu, tmp_path: Path) -> None:  # noqa: F811
    """On a (faked) AMX CPU the measurement really times TORCH_SDPA's two paths (aten made to
    look faster here), and bf16 prefill then runs on aten's kernel, conforming. The
    measurement is kept in this test's directory, not beside the real library."""
    native = torch_sdpa.native_kernel_status()
    if not native.available:
        pytest.skip(f"the native prefill kernel cannot run here: {native.reasons}")
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    timed: list[str] = []
    calibrate = torch_sdpa._time_bf16_path

    def timer(path: str) -> float:
        seconds = calibrate(path)     # the real calibration call
        timed.append(path)
        return seconds * (10.0 if path == NATIVE else 1.0)

    monkeypatch.setattr(torch_sdpa, "_calibration_file",
                        lambda: CalibrationFile(tmp_path, {"test": "conform"}))
    monkeypatch.setattr(torch_sdpa, "_time_bf16_path", timer)
    monkeypatch.setattr(cpu_bf16_path, "ROUNDS", 1)
    choice = torch_sdpa.cpu_bf16_prefill_path()
    assert choice.path == ATEN and set(timed) == {NATIVE, ATEN}
    assert TorchSDPAPrefillBackend.kernel_path(torch.bfloat16).startswith(
        "aten's CPU flash kernel in bf16 (oneDNN brgemm on AMX tiles): aten, measured faster")
    calls: list[int] = []
    original = torch_sdpa.AtenCpuPrefill.run
    monkeypatch.setattr(torch_sdpa.AtenCpuPrefill, "run",
                        lambda self, *a, **k: (calls.append(1), original(self, *a, **k))[1])
    assert_conformance(TorchSDPAPrefillBackend, device="cpu", dtype=torch.bfloat16)
    assert calls, "bf16 prefill did not run on aten's kernel"


# -- APP_CPU_AMX=0 ------------------------------------------------------------------------

def test_amx_off_takes_native_unmeasured() -> None:
    clock = Clock(2.0, 1.0)
    off = choose_bf16_prefill_path("auto", True, BOTH, clock, amx_off=True)
    assert off.path == NATIVE and clock.calls == []
    assert off.reason == ("native (APP_CPU_AMX=0: aten's bf16 kernel would run on oneDNN's AMX "
                          "tiles; not measured)")
    assert choose_bf16_prefill_path(ATEN, True, BOTH, clock, amx_off=True).path == ATEN
    only = choose_bf16_prefill_path("auto", True, {NATIVE: "none", ATEN: None}, clock,
                                    amx_off=True)
    assert only.path == ATEN and clock.calls == []


def test_the_choice_is_kept_per_amx_switch() -> None:
    clock = Clock(2.0, 1.0)
    assert cpu_bf16_path.bf16_prefill_path(True, BOTH, clock).path == ATEN
    assert cpu_bf16_path.bf16_prefill_path(True, BOTH, clock, amx_off=True).path == NATIVE
    assert cpu_bf16_path.bf16_prefill_path(True, BOTH, clock).path == ATEN


@pytest.mark.parametrize(("flags", "amx_switch", "compute", "text"), [
    (SAPPHIRE_RAPIDS, "1", torch.bfloat16,
     "aten's CPU flash kernel in bf16 (oneDNN brgemm on AMX tiles)"),
    (SAPPHIRE_RAPIDS, "0", torch.float32,
     "aten's CPU flash kernel in float32 (AVX-512 FMAs; bf16 converted: APP_CPU_AMX=0 keeps "
     "bf16 off oneDNN's AMX tiles)"),
    (ZEN4, "0", torch.bfloat16,
     "aten's CPU flash kernel in bf16 (oneDNN brgemm on AVX512-BF16 dot products)"),
    (AVX2_ONLY, "1", torch.float32,
     "aten's CPU flash kernel in float32 (AVX2 FMAs; bf16 converted: this CPU has no "
     "AVX512-BF16 or AMX)"),
], ids=["amx", "amx-off", "zen4", "avx2"])
def test_aten_says_what_it_computes_in_on_this_cpu(fake_cpu: FakeCpu,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   flags: str, amx_switch: str,
                                                   compute: torch.dtype, text: str) -> None:
    fake_cpu.flags(flags)
    monkeypatch.setenv("APP_CPU_AMX", amx_switch)
    assert torch_sdpa.cpu_compute_dtype(torch.bfloat16) == compute
    assert aten_cpu_path(torch.bfloat16) == text
    fma = "AVX2" if flags == AVX2_ONLY else "AVX-512"
    assert aten_cpu_path(torch.float16) == (f"aten's CPU flash kernel in float32 ({fma} FMAs; "
                                            f"float16 converted)")


def test_with_amx_off_bf16_prefill_never_reaches_aten_in_bf16(
        fake_cpu: FakeCpu, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Where only aten can run (the native kernel faked away), APP_CPU_AMX=0 runs aten's
    kernel in float32 (oneDNN's AMX brgemm takes only bf16/fp16 blocks); with the switch on,
    in bf16. The platform line says which."""
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.prefill_kernels(native=False)
    seen: list[torch.dtype] = []
    original = torch_sdpa.AtenCpuPrefill._cpu_run

    def spy(self: object, qb: torch.Tensor, *args: object) -> None:
        seen.append(qb.dtype)
        original(self, qb, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_sdpa.AtenCpuPrefill, "_cpu_run", spy)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(40, 2, 24, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(40, 2, 16, generator=gen).bfloat16()
    for switch, dtype in (("0", torch.float32), ("1", torch.bfloat16)):
        monkeypatch.setenv("APP_CPU_AMX", switch)
        be = TorchSDPAPrefillBackend(num_heads=2, scale=0.2, kv_lora_rank=16,
                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        be.prepare_metadata(MLAPrefillMetadata.build([40], new_kv_lens=[40]))
        seen.clear()
        out, _ = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
        assert out.dtype == torch.bfloat16 and seen and set(seen) == {dtype}
    monkeypatch.setenv("APP_CPU_AMX", "0")
    assert TorchSDPAPrefillBackend.kernel_path(torch.bfloat16).startswith(
        "aten's CPU flash kernel in float32 (AVX-512 FMAs; bf16 converted: APP_CPU_AMX=0")


# -- one measurement per machine ----------------------------------------------------------

def _kept(tmp_path: Path, **key: str) -> CalibrationFile:
    return CalibrationFile(tmp_path, key or {"machine": "m", "threads": "2"})


def test_a_measurement_is_kept_and_every_later_process_takes_it(tmp_path: Path) -> None:
    kept = _kept(tmp_path)
    first = choose_bf16_prefill_path("auto", True, BOTH, Clock(2.0, 1.0), kept=kept)
    assert first.path == ATEN and f"kept in {kept.path})" in first.reason
    assert os.stat(kept.path).st_mode & 0o777 == 0o600
    busy = Clock(1.0, 3.0)     # the next process, on a busy machine, would time the other way
    later = choose_bf16_prefill_path("auto", True, BOTH, busy, kept=kept)
    assert later.path == ATEN and busy.calls == []
    assert "not re-timed" in later.reason and "native 2000.00 ms, aten 1000.00 ms" in later.reason
    again = choose_bf16_prefill_path("measure", True, BOTH, busy, kept=kept)   # asked: anew
    assert again.path == NATIVE and busy.calls
    assert choose_bf16_prefill_path("auto", True, BOTH, Clock(5.0, 1.0), kept=kept).path == NATIVE


def test_the_first_process_to_keep_a_measurement_wins(tmp_path: Path) -> None:
    kept = _kept(tmp_path)

    class Racing(Clock):
        def __call__(self, path: str) -> float:
            if not self.calls:   # another process keeps its measurement meanwhile
                kept.keep({NATIVE: 1.0, ATEN: 2.0}, replace=False)
            return super().__call__(path)

    choice = choose_bf16_prefill_path("auto", True, BOTH, Racing(2.0, 1.0), kept=kept)
    assert choice.path == NATIVE and "by another process first" in choice.reason
    assert kept.read() == {NATIVE: 1.0, ATEN: 2.0}


def test_a_file_not_trusted_or_not_ours_is_not_read_and_is_replaced(tmp_path: Path) -> None:
    kept = _kept(tmp_path)
    good = json.dumps({"key": dict(kept.key), "seconds": {NATIVE: 1.0, ATEN: 2.0}})
    for text, mode in ((good, 0o666), ("not json", 0o600),
                       (json.dumps({"key": {"machine": "other"}, "seconds": {NATIVE: 1.0,
                                                                            ATEN: 2.0}}), 0o600),
                       (json.dumps({"key": dict(kept.key), "seconds": {NATIVE: -1.0,
                                                                      ATEN: 2.0}}), 0o600)):
        kept.path.write_text(text)
        os.chmod(kept.path, mode)
        assert kept.read() is None
    choice = choose_bf16_prefill_path("auto", True, BOTH, Clock(2.0, 1.0), kept=kept)
    assert choice.path == ATEN and kept.read() == {NATIVE: 2.0, ATEN: 1.0}
    assert _kept(tmp_path, machine="m", threads="4").path != kept.path   # another key


def test_where_nothing_can_be_kept_the_process_says_it_measured_alone(tmp_path: Path) -> None:
    kept = CalibrationFile(tmp_path / "missing", {"machine": "m"})
    choice = choose_bf16_prefill_path("auto", True, BOTH, Clock(2.0, 1.0), kept=kept)
    assert choice.path == ATEN and "not kept (" in choice.reason
    assert "measured in this process" in choice.reason


def test_torch_sdpa_takes_the_same_path_in_every_process(fake_cpu: FakeCpu,  # noqa: F811
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Two processes on one (faked) AMX machine, the second timing the other way round: both
    take the path the first measured, and ``platform`` says which rule decided."""
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    directory = fake_cpu.prefill_kernels()
    monkeypatch.setattr(torch_sdpa, "_time_bf16_path", Clock(2.0, 1.0))
    assert torch_sdpa.cpu_bf16_prefill_path().path == ATEN
    files = list(directory.glob("bf16-prefill-path-*.json"))
    assert len(files) == 1
    reset_bf16_prefill_path()                                  # the next process
    busy = Clock(1.0, 9.0)
    monkeypatch.setattr(torch_sdpa, "_time_bf16_path", busy)
    assert torch_sdpa.cpu_bf16_prefill_path().path == ATEN and busy.calls == []
    line = TorchSDPAPrefillBackend.kernel_path(torch.bfloat16)
    assert line.startswith("aten's CPU flash kernel in bf16 (oneDNN brgemm on AMX tiles): "
                           "aten, measured faster (AMX tiles present;")
    assert f"kept in {files[0]}; not re-timed" in line
    monkeypatch.setenv("APP_CPU_AMX", "0")
    assert TorchSDPAPrefillBackend.kernel_path(torch.bfloat16) == (
        "native kernel, bf16 products (vdpbf16ps): native (APP_CPU_AMX=0: aten's bf16 kernel "
        "would run on oneDNN's AMX tiles; not measured)")
