"""``BackendDeclarations.platform_reasons``: where the device already rules a backend out, its
availability is read off the installed packages (``kernel_package``) instead of importing the
kernel package; everywhere else the probe is asked as before. A probe that raises is a reason."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from app._types import ComputeCapabilities, DeviceCapability
from app.backends import (
    MLAPrefillBackendEnum,
    explain_mla_prefill_selection,
    get_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.declarations import BackendDeclarations
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.config import EngineConfig
from app.containers import create_container, use_container
from app.platforms import CpuPlatform
from tests._support import kernel_packages_imported_by

SM75, SM90 = DeviceCapability(7, 5), DeviceCapability(9, 0)
HINT = "gpu-stub is not installed"


def _must_not_probe() -> object:
    raise AssertionError("the kernel package was probed (imported) where the device rules "
                         "the backend out")


class GpuStub(BackendDeclarations):
    """A GPU backend (SM80+) whose kernel package is installed (json stands in for it)."""

    name = "GPU_STUB"
    requires_device_capability = True
    compute_capabilities = ComputeCapabilities(minimum=DeviceCapability(8, 0))
    kernel_package: ClassVar[str | None] = "json"
    install_hint = HINT
    probe = staticmethod(_must_not_probe)


class MissingStub(GpuStub):
    kernel_package = "app_test_no_such_kernel_package"


@pytest.mark.parametrize("cap", [None, SM75])
def test_a_ruled_out_backend_reports_an_installed_package_without_importing_it(
        cap: DeviceCapability | None) -> None:
    reasons = GpuStub.platform_reasons(cap, torch.float32)
    assert len(reasons) == 2 and reasons[1] == "dtype torch.float32 not supported"
    assert reasons[0] in ("device capability not available", "compute capability 7.5 not "
                                                               "supported")


@pytest.mark.parametrize("cap", [None, SM75])
def test_a_ruled_out_backend_still_names_a_missing_package(cap: DeviceCapability | None
                                                           ) -> None:
    reasons = MissingStub.platform_reasons(cap, torch.bfloat16)
    assert len(reasons) == 2 and reasons[1] == HINT


def test_a_gpu_that_could_run_it_asks_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def probe() -> object | None:
        calls.append(1)
        return None  # installed, but the entry points do not import: not available

    monkeypatch.setattr(GpuStub, "probe", staticmethod(probe))
    assert GpuStub.platform_reasons(SM90, torch.bfloat16) == [HINT]
    assert calls == [1]


def test_an_overridden_is_available_is_always_asked() -> None:
    class Custom(GpuStub):
        asked: ClassVar[list[int]] = []

        @classmethod
        def is_available(cls) -> bool:
            cls.asked.append(1)
            return False

    assert Custom.platform_reasons(None, torch.bfloat16) == [
        "device capability not available", HINT]
    assert Custom.asked == [1]


def test_a_subclass_that_swaps_the_probe_alone_is_asked_its_probe() -> None:
    asked: list[int] = []

    def probe() -> object | None:
        asked.append(1)
        return None

    class OtherKernel(GpuStub):  # a different kernel, its package not named
        pass

    OtherKernel.probe = staticmethod(probe)
    assert OtherKernel.platform_reasons(None, torch.bfloat16) == [
        "device capability not available", HINT]
    assert asked == [1]


@pytest.mark.slow
def test_selecting_on_a_cpu_imports_no_gpu_kernel_package() -> None:
    code = ("from app.backends import explain_mla_decode_selection, "
            "explain_mla_prefill_selection\n"
            "explain_mla_prefill_selection()\n"
            "explain_mla_decode_selection()\n"
            "explain_mla_decode_selection(query_len=4)\n")
    assert kernel_packages_imported_by(code) == []


def _raises(exc: BaseException) -> object:
    raise exc


@pytest.mark.parametrize("exc", [ZeroDivisionError("division by zero"),
                                 OSError("libcuda.so.1: cannot open shared object file"),
                                 RuntimeError("CUDA driver\ntoo old"),
                                 ImportError("no flashinfer")])
def test_a_probe_that_raises_is_a_reason_and_selection_goes_on(exc: BaseException) -> None:
    class Crashing(TorchSDPABackend):
        probe = staticmethod(lambda: _raises(exc))

    class Fallback(TorchSDPABackend):
        pass

    class CrashingFirst(CpuPlatform):
        def mla_prefill_backend_priorities(self, selector_config: object) -> list[str]:
            return ["TORCH_SDPA", "CUSTOM"]

    with use_container(create_container(platform=CrashingFirst())):
        register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, Crashing)
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Fallback)
        explanation = explain_mla_prefill_selection()
        message = " ".join(str(exc).split())
        assert explanation["backends"]["TORCH_SDPA"]["reasons"] == [
            f"availability check raised {type(exc).__name__}: {message}"]
        assert get_mla_prefill_backend() is Fallback  # the next backend in the list
        with pytest.raises(ValueError, match=rf"Reason: \['availability check raised "
                                             rf"{type(exc).__name__}: "):
            get_mla_prefill_backend(EngineConfig.from_dict(
                {"attention": {"mla_prefill_backend": "TORCH_SDPA"}}))
        assert Crashing.platform_reasons(None, torch.int8) == [
            "dtype torch.int8 not supported",
            f"availability check raised {type(exc).__name__}: {message}"]
