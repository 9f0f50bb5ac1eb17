"""``APP_PLATFORM`` pins what platform detection answers (and the benchmarks' default device)."""

from __future__ import annotations

import pytest
import torch

from app.platforms import (
    PLATFORM_ENV,
    CpuPlatform,
    CudaPlatform,
    DeviceCapability,
    default_device,
    detect_platform,
    platform_from_environment,
)


@pytest.mark.parametrize("value", ["", "auto", "  auto "])
def test_unset_empty_or_auto_detects(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PLATFORM_ENV, value)
    assert platform_from_environment() is None
    monkeypatch.delenv(PLATFORM_ENV)
    assert platform_from_environment() is None


def test_cpu_and_an_emulated_gpu_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLATFORM_ENV, "cpu")
    assert isinstance(detect_platform(), CpuPlatform)
    assert default_device() == torch.device("cpu")
    monkeypatch.setenv(PLATFORM_ENV, "cuda:9.0")
    platform = detect_platform()
    assert isinstance(platform, CudaPlatform) and platform.is_emulated
    assert platform.get_device_capability() == DeviceCapability(9, 0)
    assert default_device() == torch.device("cuda", 0)


def test_the_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLATFORM_ENV, "cuda")
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine
        assert isinstance(detect_platform(), CudaPlatform)
        return
    with pytest.raises(ValueError, match=r"^APP_PLATFORM='cuda': CudaPlatform: CUDA is not"):
        detect_platform()


@pytest.mark.parametrize(("value", "message"), [
    ("gpu", "expected auto, cpu, cuda or cuda:MAJOR.MINOR"),
    ("cpu:9.0", "expected auto, cpu, cuda or cuda:MAJOR.MINOR"),
    ("CUDA", "expected auto, cpu, cuda or cuda:MAJOR.MINOR"),
    ("cuda:99.9", "expected MAJOR.MINOR with ASCII digits"),
    ("cuda:", "expected MAJOR.MINOR with ASCII digits"),
])
def test_anything_else_is_a_value_error(monkeypatch: pytest.MonkeyPatch, value: str,
                                        message: str) -> None:
    monkeypatch.setenv(PLATFORM_ENV, value)
    for call in (platform_from_environment, detect_platform, default_device):
        with pytest.raises(ValueError, match=f"^APP_PLATFORM={value!r}: ") as info:
            call()
        assert message in str(info.value)


def test_the_bench_default_device_follows_the_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.commands._args import resolve_device

    monkeypatch.setenv(PLATFORM_ENV, "cpu")
    assert resolve_device(None) == torch.device("cpu")
    monkeypatch.setenv(PLATFORM_ENV, "cuda:9.0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            resolve_device(None)


def test_the_suite_pins_the_cpu_for_an_unmarked_test() -> None:
    # tests/conftest.py: what makes the suite pass on a GPU machine too.
    assert isinstance(detect_platform(), CpuPlatform)


@pytest.mark.detected_platform
def test_a_marked_test_sees_the_machine() -> None:
    import os

    assert PLATFORM_ENV not in os.environ
    expected = CudaPlatform if torch.cuda.is_available() else CpuPlatform
    assert isinstance(detect_platform(), expected)
