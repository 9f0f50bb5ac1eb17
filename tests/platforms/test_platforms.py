"""Platform detection, the fake-capability CUDA platform and backend priorities."""

from __future__ import annotations

import pytest
import torch

from app._types import MLADimensions
from app.backends.prefill.base import MLAPrefillSelectorConfig
from app.platforms import CpuPlatform, CudaPlatform, DeviceCapability, Platform, detect_platform

R1 = MLAPrefillSelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))
V32 = MLAPrefillSelectorConfig(torch.bfloat16, MLADimensions(192, 64, 256))


@pytest.mark.detected_platform
def test_detection_matches_the_machine() -> None:
    platform = detect_platform()
    if torch.cuda.is_available():
        assert isinstance(platform, CudaPlatform)
        assert platform.get_device_capability() is not None
    else:
        assert isinstance(platform, CpuPlatform)
        assert platform.get_device_capability() is None
        assert platform.device == torch.device("cpu")


def test_cpu_priorities_and_description() -> None:
    cpu = CpuPlatform()
    assert cpu.mla_prefill_backend_priorities(R1) == ["TORCH_SDPA"]
    info = cpu.describe()
    assert info["platform"] == "cpu" and info["device_capability"] is None
    assert isinstance(cpu.has_fast_bfloat16(), bool)


def test_fake_capability_cuda_platform_needs_no_gpu() -> None:
    blackwell = CudaPlatform(device_capability=DeviceCapability(10, 0))
    assert blackwell.get_device_capability() == DeviceCapability(10, 0)
    assert blackwell.is_emulated
    assert blackwell.describe()["device_capability"] == "10.0"
    assert blackwell.device == torch.device("cuda", 0)


@pytest.mark.parametrize("cap, dims, expected", [
    ((10, 0), R1, ["FLASH_ATTN", "TRTLLM_RAGGED", "FLASHINFER", "TOKENSPEED_MLA", "TORCH_SDPA"]),
    ((10, 3), V32, ["TRTLLM_RAGGED", "FLASH_ATTN", "FLASHINFER", "TOKENSPEED_MLA", "TORCH_SDPA"]),
    ((9, 0), R1, ["FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]),
    ((8, 0), R1, ["FLASH_ATTN", "TORCH_SDPA"]),
    ((12, 0), R1, ["FLASH_ATTN", "TORCH_SDPA"]),
])
def test_cuda_priorities(cap: tuple[int, int], dims: MLAPrefillSelectorConfig,
                         expected: list[str]) -> None:
    platform = CudaPlatform(device_capability=DeviceCapability(*cap))
    assert platform.mla_prefill_backend_priorities(dims) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_platform_without_gpu_says_how_to_emulate() -> None:
    with pytest.raises(ValueError, match="device_capability=DeviceCapability"):
        CudaPlatform()


def test_bad_platform_arguments() -> None:
    with pytest.raises(TypeError, match="DeviceCapability"):
        CudaPlatform(device_capability=(9, 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_index"):
        CudaPlatform(device_capability=DeviceCapability(9, 0), device_index=-1)
    with pytest.raises(ValueError, match="minor"):
        DeviceCapability(9, -1)
    with pytest.raises(TypeError, match="major"):
        DeviceCapability("9", 0)  # type: ignore[arg-type]


def test_capabilities_order_and_hash() -> None:
    assert DeviceCapability(9, 0) < DeviceCapability(10, 0)
    assert DeviceCapability(10, 3).to_int() == 103
    assert len({DeviceCapability(9, 0), DeviceCapability(9, 0)}) == 1
    assert len({MLADimensions(128, 64, 128), MLADimensions(128, 64, 128)}) == 1


def test_custom_platform_subclass_gets_the_default_hook() -> None:
    class Npu(Platform):
        name = "npu"

        def get_device_capability(self) -> DeviceCapability | None:
            return None

        def mla_prefill_backend_priorities(self, selector_config: object) -> list[str]:
            return ["CUSTOM"]

    npu = Npu()
    assert npu.register_custom_kv_cache_specs(object(), None) is None
    assert npu.mla_prefill_backend_priorities(R1) == ["CUSTOM"]
