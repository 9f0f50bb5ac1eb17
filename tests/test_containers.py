"""The composition root: default container, use_container scopes, overrides, isolation."""

from __future__ import annotations

import asyncio
import threading

import pytest
from dependency_injector import providers

from app.backends.catalog import PREFILL_BACKENDS
from app.config import EngineConfig, ModelConfig
from app.containers import (
    Application,
    create_container,
    get_container,
    reset_default_container,
    set_default_container,
    use_container,
)
from app.platforms import CpuPlatform, CudaPlatform, DeviceCapability


def test_default_container_is_a_process_singleton() -> None:
    assert get_container() is get_container()
    assert isinstance(get_container().config(), EngineConfig)


def test_use_container_scopes_and_nests() -> None:
    outer, inner = create_container(), create_container()
    default = get_container()
    with use_container(outer):
        assert get_container() is outer
        with use_container(inner):
            assert get_container() is inner
        assert get_container() is outer
    assert get_container() is default


def test_use_container_restores_on_exception() -> None:
    default = get_container()
    with pytest.raises(RuntimeError), use_container(create_container()):
        raise RuntimeError("boom")
    assert get_container() is default


def test_use_container_is_isolated_across_threads() -> None:
    containers = [create_container(), create_container()]
    barrier = threading.Barrier(2)
    seen: dict[int, list[bool]] = {0: [], 1: []}

    def worker(i: int) -> None:
        with use_container(containers[i]):
            for _ in range(200):
                barrier.wait(timeout=10)
                seen[i].append(get_container() is containers[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0] == [True] * 200 and seen[1] == [True] * 200


def test_a_new_thread_sees_the_default_not_the_caller_scope() -> None:
    found: list[Application] = []
    with use_container(create_container()):
        t = threading.Thread(target=lambda: found.append(get_container()))
        t.start()
        t.join()
    assert found == [get_container()]


def test_use_container_is_isolated_across_asyncio_tasks() -> None:
    a, b = create_container(), create_container()

    async def task(c: Application) -> bool:
        with use_container(c):
            await asyncio.sleep(0.01)
            return get_container() is c

    async def main() -> list[bool]:
        return list(await asyncio.gather(task(a), task(b)))

    assert asyncio.run(main()) == [True, True]


def test_create_container_config_and_platform() -> None:
    cfg = EngineConfig(model=ModelConfig(num_heads=4))
    blackwell = CudaPlatform(device_capability=DeviceCapability(10, 0))
    c = create_container(cfg, platform=blackwell)
    assert c.config() is cfg
    assert c.platform() is blackwell
    d = create_container({"model": {"num_heads": 2}})
    assert d.config().model.num_heads == 2
    assert c.platform() is not d.platform()
    with pytest.raises(TypeError, match="config"):
        create_container(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="platform"):
        create_container(platform="cuda")  # type: ignore[arg-type]


def test_provider_override_is_per_container_and_scoped() -> None:
    a, b = create_container(), create_container()
    cpu = CpuPlatform()
    with a.platform.override(providers.Object(cpu)):
        assert a.platform() is cpu
        assert b.platform() is not cpu
    assert a.platform() is not cpu


def test_backend_providers_are_named_and_lazy() -> None:
    c = create_container()
    for name, path in PREFILL_BACKENDS.builtins.items():
        assert getattr(c.mla_prefill_backends, name).args == (path,)
    assert c.mla_prefill_backends.CUSTOM() is None
    sentinel = type("Sentinel", (), {})
    c.mla_prefill_backends.FLASHINFER.override(providers.Object(sentinel))
    assert c.mla_prefill_backends.FLASHINFER() is sentinel
    assert create_container().mla_prefill_backends.FLASHINFER.overridden == ()


def test_singletons_are_per_container() -> None:
    a, b = create_container(), create_container()
    assert a.selection_cache() is a.selection_cache()
    assert a.selection_cache() is not b.selection_cache()
    assert a.kernel_workspaces() is not b.kernel_workspaces()


def test_set_and_reset_default_container() -> None:
    mine = create_container()
    try:
        set_default_container(mine)
        assert get_container() is mine
    finally:
        reset_default_container()
    assert get_container() is not mine


def test_use_container_rejects_non_containers() -> None:
    with pytest.raises(TypeError, match="Application"), use_container("nope"):  # type: ignore[arg-type]
        pass
    with pytest.raises(TypeError, match="Application"):
        set_default_container(object())  # type: ignore[arg-type]
