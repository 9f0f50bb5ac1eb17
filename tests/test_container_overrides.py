"""Every provider of the container can be overridden at any time, and the override takes effect
(nothing is stashed on the container instance or resolved once behind its back)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dependency_injector import providers

from app._types import DeviceCapability
from app.backends import (
    MLAPrefillBackendEnum,
    get_mla_decode_backend,
    get_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.backends.selection import SelectionCache
from app.backends.workspaces import KernelWorkspaces
from app.config import EngineConfig
from app.containers import Application, create_container, use_container
from app.kvcache import FullAttentionSpec, KVCacheSpecBindings, KVCacheSpecRegistry
from app.platforms import CpuPlatform, CudaPlatform, Platform
from app.plugins import apply_general_plugins
from app.testing import SelectionOnlyBackend


class Stub(SelectionOnlyBackend):
    @staticmethod
    def get_name() -> str:
        return "STUB"


class Other(Stub):
    pass


class MySDPA(TorchSDPABackend):
    pass


class MyDecode(TorchSDPADecodeBackend):
    pass


SPEC = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)


def used_then_overridden(container: Application) -> Application:
    """Resolve what the tests override, so that an override must beat a cached result."""
    container.mla_prefill_backend_class()
    container.mla_decode_backend_class()
    container.kv_cache_spec_bindings().get_manager_class(SPEC)
    return container


def test_config() -> None:
    c = used_then_overridden(create_container())
    forced = EngineConfig.from_dict({"attention": {"mla_prefill_backend": "CUSTOM"}})
    c.config.override(providers.Object(forced))
    with pytest.raises(ValueError, match="CUSTOM must be registered"):
        c.mla_prefill_backend_class()
    with pytest.raises(ValueError, match="CUSTOM must be registered"):
        get_mla_prefill_backend(container=c)


def test_platform() -> None:
    c = used_then_overridden(create_container(platform=CpuPlatform()))
    c.platform.override(providers.Object(CudaPlatform(device_capability=DeviceCapability(9, 0))))
    with use_container(c), register_override("FLASH_ATTN", Stub):
        assert c.mla_prefill_backend_class() is Stub  # SM90 priorities now
    c.mla_decode_backends.FLASHINFER_MLA.override(providers.Object(MyDecode))
    assert c.mla_decode_backend_class() is MyDecode  # SM90 decode priorities now
    backend = c.mla_decode_backend()
    assert backend.device_capability == DeviceCapability(9, 0)


def register_override(name: str, cls: type[Any]) -> Any:
    from app.backends import override_mla_prefill_backend

    return override_mla_prefill_backend(name, cls)


@pytest.mark.parametrize("name", [*MLAPrefillBackendEnum.__members__][:6])
def test_each_prefill_backend_provider(name: str) -> None:
    config = EngineConfig.from_dict({"attention": {"mla_prefill_backend": name}})
    c = create_container(config, CpuPlatform())
    with contextlib.suppress(ValueError):  # not valid on this CPU: the override wins below
        c.mla_prefill_backend_class()
    getattr(c.mla_prefill_backends, name).override(providers.Object(Stub))
    assert c.mla_prefill_backend_class() is Stub
    getattr(c.mla_prefill_backends, name).override(providers.Object(Other))
    assert get_mla_prefill_backend(container=c) is Other


@pytest.mark.parametrize("name", ["CPU_MLA", "TORCH_SDPA", "FLASHINFER_MLA", "TOKENSPEED_MLA",
                                  "CUSTOM"])
def test_each_decode_backend_provider(name: str) -> None:
    config = EngineConfig.from_dict({"attention": {"mla_decode_backend": name}})
    c = create_container(config, CpuPlatform())
    with contextlib.suppress(ValueError):
        c.mla_decode_backend_class()
    getattr(c.mla_decode_backends, name).override(providers.Object(MyDecode))
    assert c.mla_decode_backend_class() is MyDecode
    assert get_mla_decode_backend(container=c) is MyDecode
    assert isinstance(c.mla_decode_backend(), MyDecode)


def test_selection_cache() -> None:
    c = used_then_overridden(create_container())
    mine = SelectionCache()
    c.selection_cache.override(providers.Object(mine))
    get_mla_prefill_backend(container=c)
    assert mine.misses == 1 and len(mine) == 1


def test_kernel_workspaces() -> None:
    c = create_container(EngineConfig.from_dict(
        {"attention": {"mla_prefill_backend": "TORCH_SDPA"}}), CpuPlatform())
    c.mla_prefill_backend()
    mine = KernelWorkspaces()
    c.kernel_workspaces.override(providers.Object(mine))
    assert c.mla_prefill_backend().workspaces is mine


def test_kv_cache_spec_bindings() -> None:
    c = used_then_overridden(create_container())
    mine = KVCacheSpecBindings()
    c.kv_cache_spec_bindings.override(providers.Object(mine))
    with use_container(c):
        KVCacheSpecRegistry.register(type("MySpec", (FullAttentionSpec,), {}),
                                     KVCacheSpecRegistry.get_manager_class(SPEC))
        assert KVCacheSpecRegistry.bindings() is mine
    assert len(mine.registered_specs()) > len(KVCacheSpecBindings().registered_specs())


def test_backend_class_providers() -> None:
    c = used_then_overridden(create_container())
    c.mla_prefill_backend_class.override(providers.Object(MySDPA))
    assert isinstance(c.mla_prefill_backend(), MySDPA)
    c.mla_decode_backend_class.override(providers.Object(MyDecode))
    assert isinstance(c.mla_decode_backend(), MyDecode)


def test_backend_instance_providers() -> None:
    c = create_container()
    sentinel = object()
    c.mla_prefill_backend.override(providers.Object(sentinel))
    c.mla_decode_backend.override(providers.Object(sentinel))
    assert c.mla_prefill_backend() is sentinel and c.mla_decode_backend() is sentinel


def test_applied_general_plugins() -> None:
    c = create_container(plugins=False)
    mine: dict[str, bool] = {}
    c.applied_general_plugins.override(providers.Object(mine))
    assert apply_general_plugins(c) == mine


def test_registration_after_selection_takes_effect() -> None:
    c = create_container(EngineConfig.from_dict(
        {"attention": {"mla_prefill_backend": "CUSTOM"}}), CpuPlatform())
    with pytest.raises(ValueError):
        c.mla_prefill_backend_class()
    with use_container(c):
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Stub)
    assert c.mla_prefill_backend_class() is Stub


def test_fake_platform_reaches_kernel_launches(
        app_container: Application,
        fake_platform: Callable[[Any], Platform]) -> None:
    """The capability a test pretends reaches the backend the container builds, and so the
    path its launch takes (no torch.cuda query at launch)."""
    app_container.config.override(providers.Object(EngineConfig.from_dict(
        {"attention": {"mla_prefill_backend": "TORCH_SDPA"}})))
    fake_platform((8, 0))
    backend = app_container.mla_prefill_backend()
    assert backend.device_capability == DeviceCapability(8, 0)
    assert backend.cuda_kernel(torch.bfloat16) == "flash"
    fake_platform((7, 5))
    assert app_container.mla_prefill_backend().cuda_kernel(torch.bfloat16) == "efficient"
    fake_platform(None)
    with pytest.raises(ValueError, match="device_capability"):
        app_container.mla_prefill_backend().cuda_kernel(torch.bfloat16)


def test_decode_providers_take_the_query_length() -> None:
    """``mla_decode_backend_class(query_len=N)`` / ``mla_decode_backend(query_len=N)`` select for
    that query length; the instance is built with the platform's capability."""
    from app.backends.decode.base import MLADecodeBackend

    c = create_container(EngineConfig.from_dict({"model": {"dtype": "float32"}}),
                         CpuPlatform())
    for query_len in (1, 3):
        cls = c.mla_decode_backend_class(query_len=query_len)
        backend = c.mla_decode_backend(query_len=query_len)
        assert isinstance(backend, cls) and isinstance(backend, MLADecodeBackend)
        assert backend.device_capability is None
    with pytest.raises(ValueError, match="query_len"):
        c.mla_decode_backend(query_len=99)
