"""FLASHINFER_MLA and TOKENSPEED_MLA as the container builds them, on pretend GPUs (no GPU).

The container picks the decode backend from the platform's priorities and builds it with the
platform's capability (``from_config``): the kernel follows the capability, the cache block size
comes from the config, and a block size the kernel cannot read fails at start-up naming the ones
it accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector import providers

from app.backends.decode.flashinfer_mla import FlashInferMLADecodeBackend
from app.backends.decode.tokenspeed_mla import TokenSpeedMLADecodeBackend
from app.config import EngineConfig


def _built(app_container: Any, block_size: int) -> Any:
    app_container.config.override(providers.Object(EngineConfig.from_dict(
        {"cache": {"block_size": block_size}})))
    return app_container.mla_decode_backend()


@pytest.mark.parametrize(("capability", "block_size", "cls", "kernel"), [
    ((9, 0), 16, FlashInferMLADecodeBackend, "fa3"),
    ((8, 0), 16, FlashInferMLADecodeBackend, "fa2"),
    ((10, 0), 64, FlashInferMLADecodeBackend, "trtllm-gen"),
    ((10, 3), 32, FlashInferMLADecodeBackend, "trtllm-gen"),
    ((10, 0), 16, TokenSpeedMLADecodeBackend, None),   # trtllm-gen cannot read 16
])
def test_the_container_builds_the_gpu_decode_backends(
        app_container: Any, fake_platform: Callable[[Any], Any], capability: tuple[int, int],
        block_size: int, cls: type, kernel: str | None) -> None:
    pytest.importorskip("flashinfer")
    pytest.importorskip("tokenspeed_mla")
    fake_platform(capability)
    backend = _built(app_container, block_size)
    assert type(backend) is cls
    assert backend.device_capability.major == capability[0]
    if kernel is not None:
        assert backend.kernel == kernel and backend.block_size == block_size


def test_a_forced_flashinfer_with_a_block_size_trtllm_gen_cannot_read_fails_at_start(
        app_container: Any, fake_platform: Callable[[Any], Any]) -> None:
    pytest.importorskip("flashinfer")
    fake_platform((10, 0))
    app_container.config.override(providers.Object(EngineConfig.from_dict(
        {"cache": {"block_size": 16}, "attention": {"mla_decode_backend": "FLASHINFER_MLA"}})))
    with pytest.raises(ValueError, match=r"block size 16 not supported by flashinfer's "
                                         r"trtllm-gen MLA kernel on SM100 \(supported: 32, 64\)"):
        app_container.mla_decode_backend()
