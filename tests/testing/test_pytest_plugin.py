"""The fixtures shipped in app.testing.pytest_plugin, used the way a user's tests use them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from app.backends import (
    MLAPrefillBackendEnum,
    explain_mla_prefill_selection,
    get_mla_prefill_backend,
)
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.config import EngineConfig, ModelConfig
from app.containers import Application, get_container
from app.platforms import CpuPlatform, CudaPlatform, DeviceCapability, Platform


class OverriddenSDPA(TorchSDPABackend):
    """What a test swaps in for TORCH_SDPA."""


CONFIG = EngineConfig(model=ModelConfig(dtype=torch.bfloat16))


def test_the_plugin_is_registered_through_its_entry_point(
        pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.hasplugin("app")


def test_app_container_is_fresh_and_active(app_container: Application) -> None:
    assert get_container() is app_container


def test_override_prefill_backend(app_container: Application,
                                  override_prefill_backend: Callable[[Any, Any], None],
                                  fake_platform: Callable[[Any], Platform]) -> None:
    fake_platform(None)
    override_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, OverriddenSDPA)
    assert get_mla_prefill_backend(CONFIG) is OverriddenSDPA


def test_overrides_do_not_outlive_their_test(app_container: Application) -> None:
    # Runs after the test above: its override was on that test's container only.
    assert not MLAPrefillBackendEnum.TORCH_SDPA.is_overridden()
    assert not get_container().mla_prefill_backends.TORCH_SDPA.overridden


@pytest.mark.parametrize("capability, first", [
    ((9, 0), "FLASH_ATTN"), ((10, 0), "FLASH_ATTN"), ((8, 0), "FLASH_ATTN")])
def test_fake_platform_drives_selection(fake_platform: Callable[[Any], Platform],
                                        capability: tuple[int, int], first: str) -> None:
    platform = fake_platform(capability)
    assert isinstance(platform, CudaPlatform)
    assert platform.get_device_capability() == DeviceCapability(*capability)
    info = explain_mla_prefill_selection(CONFIG)
    assert info["priorities"][0] == first
    chosen = info["chosen"]
    assert chosen is not None  # TORCH_SDPA is the fallback on every GPU
    assert info["backends"][chosen]["valid"]
    # Every backend ahead of the chosen one in the priority list was invalid, with reasons.
    for name in info["priorities"][: info["priorities"].index(chosen)]:
        assert info["backends"][name]["reasons"]


def test_fake_cpu_platform(fake_platform: Callable[[Any], Platform]) -> None:
    assert isinstance(fake_platform(None), CpuPlatform)
    assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
