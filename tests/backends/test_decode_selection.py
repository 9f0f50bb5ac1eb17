"""Decode backends in the shared registry: selection by platform and query_len, the enum and
the registration functions, deployments, and the start-up block-size check."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
from dependency_injector import providers

from app.backends import (
    MLADecodeBackendEnum,
    check_decode_block_size,
    explain_mla_decode_selection,
    get_mla_decode_backend,
    override_mla_decode_backend,
    register_mla_decode_backend,
)
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.config import EngineConfig
from app.containers import Application, create_container, use_container
from app.platforms import CpuPlatform, CudaPlatform, DeviceCapability


class Stub(TorchSDPADecodeBackend):
    """A decode backend valid everywhere (the stand-in for a GPU kernel here)."""

    validations = 0

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: object) -> list[str]:
        Stub.validations += 1
        return super().validate_configuration(device_capability, selector_config)  # type: ignore[arg-type]


class FlashStub(Stub):
    pass


class TokenStub(Stub):
    pass


class Block64(Stub):
    supported_block_sizes: ClassVar[tuple[int, ...]] = (32, 64)


def sm100() -> Application:
    c = create_container(EngineConfig(), CudaPlatform(device_capability=DeviceCapability(10, 0)))
    c.mla_decode_backends.FLASHINFER_MLA.override(providers.Object(FlashStub))
    c.mla_decode_backends.TOKENSPEED_MLA.override(providers.Object(TokenStub))
    return c


def test_sm100_prefers_tokenspeed_for_multi_token_prediction() -> None:
    c = sm100()
    assert get_mla_decode_backend(container=c) is FlashStub
    assert get_mla_decode_backend(query_len=4, container=c) is TokenStub
    assert get_mla_decode_backend(container=c) is FlashStub  # query_len is in the cache key
    explanation = explain_mla_decode_selection(query_len=2, container=c)
    assert explanation["priorities"] == ["TOKENSPEED_MLA", "FLASHINFER_MLA", "TORCH_SDPA"]
    assert explanation["selector_config"]["query_len"] == 2


@pytest.mark.parametrize(("cap", "first"), [((9, 0), "FLASHINFER_MLA"), (None, "CPU_MLA")])
def test_priorities_per_platform(cap: tuple[int, int] | None, first: str) -> None:
    platform = CpuPlatform() if cap is None else CudaPlatform(
        device_capability=DeviceCapability(*cap))
    explanation = explain_mla_decode_selection(container=create_container(platform=platform))
    assert explanation["priorities"] == [first, "TORCH_SDPA"]


def test_cached_decode_selection_does_not_validate_again() -> None:
    c = sm100()
    get_mla_decode_backend(container=c)
    before = Stub.validations
    for _ in range(3):
        get_mla_decode_backend(container=c)
    assert Stub.validations == before


def test_register_override_and_new_names(app_container: Application) -> None:
    assert not MLADecodeBackendEnum.CUSTOM.is_registered()
    register_mla_decode_backend(MLADecodeBackendEnum.CUSTOM, Stub)
    assert MLADecodeBackendEnum.CUSTOM.get_class() is Stub
    with override_mla_decode_backend("TORCH_SDPA", FlashStub) as member:
        assert member.get_class() is FlashStub
    assert MLADecodeBackendEnum.TORCH_SDPA.get_class() is TorchSDPADecodeBackend
    register_mla_decode_backend("MY_DECODE_KERNEL", TokenStub)
    config = EngineConfig.from_dict({"attention": {"mla_decode_backend": "MY_DECODE_KERNEL"}})
    assert get_mla_decode_backend(config) is TokenStub
    with pytest.raises(ValueError, match=r"Unknown MLA decode backend: 'NOPE'\. Valid options"):
        MLADecodeBackendEnum["NOPE"]
    with pytest.raises(ValueError, match="already exists in MLADecodeBackendEnum"):
        register_mla_decode_backend("TORCH_SDPA", Stub)
    # the prefill enum is untouched by decode names
    from app.backends import MLAPrefillBackendEnum

    assert "MY_DECODE_KERNEL" not in MLAPrefillBackendEnum.__members__


def test_block_size_check_lists_what_the_backend_accepts() -> None:
    check_decode_block_size(Block64, 64)
    check_decode_block_size(TorchSDPADecodeBackend, 48)  # any block size
    with pytest.raises(ValueError, match=r"block_size = 16.*accepts block sizes 32, 64"):
        check_decode_block_size(Block64, 16)


def test_deployment_registers_decode_backends(tmp_path: Path) -> None:
    from app import deployment

    path = tmp_path / "d.toml"
    path.write_text(f"""
[deployment]
platform = "cpu"
decode_backend = "DEPLOYED_DECODE"
[decode_backends]
DEPLOYED_DECODE = "{__name__}.TokenStub"
TORCH_SDPA = "{__name__}.FlashStub"
""")
    container = deployment.load(path)
    assert container.config().attention.mla_decode_backend == "DEPLOYED_DECODE"
    assert container.mla_decode_backend_class() is TokenStub
    assert container.mla_decode_backends.TORCH_SDPA() is FlashStub
    assert isinstance(container.mla_decode_backend(), TokenStub)
    with use_container(create_container()):
        assert MLADecodeBackendEnum.TORCH_SDPA.get_class() is TorchSDPADecodeBackend


def test_config_decode_backend_round_trips() -> None:
    config = EngineConfig.from_dict({"attention": {"mla_decode_backend": "TORCH_SDPA"}})
    assert EngineConfig.from_dict(config.to_dict()) == config
    assert config.attention.mla_decode_backend == "TORCH_SDPA"
    assert torch.bfloat16 == config.model.dtype


def test_check_decode_block_size_types_its_arguments() -> None:
    from app.backends import check_decode_block_size
    from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend

    with pytest.raises(TypeError, match="expected an MLADecodeBackend subclass, got <class"):
        check_decode_block_size(int, 16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"block_size = '16': expected an int, got str"):
        check_decode_block_size(TorchSDPADecodeBackend, "16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="= True: expected an int, got bool"):
        check_decode_block_size(TorchSDPADecodeBackend, True)
    with pytest.raises(ValueError, match="accepts block sizes any >= 1"):
        check_decode_block_size(TorchSDPADecodeBackend, 0)
    check_decode_block_size(TorchSDPADecodeBackend, 5)
