"""Which kernel TORCH_SDPA runs bf16 prefill on (``app.backends.prefill.cpu_bf16_path``): chosen
by measured speed on AMX CPUs (faked here with a timer), native without measuring elsewhere,
forced by ``APP_CPU_PREFILL_PATH``; and both paths are correct on any CPU, so whichever the
measurement picks on an AMX machine computes the same attention."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from app.backends.prefill import cpu_bf16_path, torch_sdpa
from app.backends.prefill.cpu_bf16_path import (
    ATEN,
    NATIVE,
    choose_bf16_prefill_path,
    reset_bf16_prefill_path,
)
from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend
from app.testing import assert_conformance

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


def test_torch_sdpa_follows_the_choice_and_both_paths_conform(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """On a (faked) AMX CPU the measurement really times TORCH_SDPA's two paths (aten made to
    look faster here), and bf16 prefill then runs on aten's kernel, conforming."""
    native = torch_sdpa.native_kernel_status()
    if not native.available:
        pytest.skip(f"the native prefill kernel cannot run here: {native.reasons}")
    timed: list[str] = []
    calibrate = torch_sdpa._time_bf16_path

    def timer(path: str) -> float:
        seconds = calibrate(path)     # the real calibration call
        timed.append(path)
        return seconds * (10.0 if path == NATIVE else 1.0)

    monkeypatch.setattr(torch_sdpa, "cpu_has_amx", lambda: True)
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
