"""The seed API keeps its answers (``get_mla_*_backend``, ``KVCacheSpecRegistry
.get_manager_class``) only while nothing they depend on changes: every way of changing a
provider, made at any time, is seen on the next call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector import providers

from app._container_state import CHANGES
from app._types import DeviceCapability
from app.backends import (
    MLADecodeBackendEnum,
    MLAPrefillBackendEnum,
    get_mla_decode_backend,
    get_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.config import EngineConfig
from app.containers import (
    create_container,
    get_container,
    reset_default_container,
    set_default_container,
    use_container,
)
from app.kvcache import (
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheSpecBindings,
    KVCacheSpecRegistry,
    SlidingWindowManager,
)
from app.platforms import CpuPlatform, CudaPlatform
from app.testing import SelectionOnlyBackend

CONFIG = EngineConfig()


class Mine(SelectionOnlyBackend):
    """A prefill backend valid everywhere."""

    name = "MINE"


class MyDecode(TorchSDPADecodeBackend):
    """A decode backend valid wherever TORCH_SDPA is."""

    name = "MY_DECODE"


def _changes_of(action: Callable[[], Any]) -> int:
    before = CHANGES.count
    action()
    return CHANGES.count - before


def test_every_kind_of_provider_change_is_counted() -> None:
    c = create_container(CONFIG, CpuPlatform())
    backends = c.mla_prefill_backends()
    assert _changes_of(lambda: c.platform.override(providers.Object(CpuPlatform()))) == 1
    assert _changes_of(lambda: c.platform.reset_override()) == 1
    assert _changes_of(lambda: c.platform.reset()) == 1
    assert _changes_of(lambda: backends.TORCH_SDPA.override(providers.Object(Mine))) == 1
    assert _changes_of(lambda: backends.TORCH_SDPA.reset_last_overriding()) == 1
    assert _changes_of(lambda: c.override_providers(config=providers.Object(CONFIG))) >= 1
    assert _changes_of(c.reset_singletons) >= 1
    assert _changes_of(lambda: c.mla_prefill_backends.override(
        providers.Container(type(backends)))) == 1
    assert _changes_of(lambda: None) == 0


def test_a_cached_selection_sees_a_direct_override_made_later() -> None:
    c = create_container(CONFIG, CpuPlatform())
    with use_container(c):
        assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
        c.mla_prefill_backends().TORCH_SDPA.override(providers.Object(Mine))
        assert get_mla_prefill_backend(CONFIG) is Mine
        c.mla_prefill_backends().TORCH_SDPA.reset_override()
        assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
        register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN, Mine)
        assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend  # not in a CPU's list
        with c.platform.override(providers.Object(CudaPlatform(
                device_capability=DeviceCapability(9, 0)))):
            assert get_mla_prefill_backend(CONFIG) is Mine  # first in SM90's list
            assert get_mla_prefill_backend() is Mine
        assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
        forced = EngineConfig.from_dict({"attention": {"mla_prefill_backend": "CUSTOM"}})
        c.config.override(providers.Object(forced))
        with pytest.raises(ValueError, match="must be registered"):
            get_mla_prefill_backend()
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Mine)
        assert get_mla_prefill_backend() is Mine


def test_cached_answers_follow_the_active_container_and_the_default() -> None:
    a, b = create_container(CONFIG, CpuPlatform()), create_container(CONFIG, CpuPlatform())
    with use_container(a):
        register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, Mine)
    with use_container(a):
        assert get_mla_prefill_backend(CONFIG) is Mine
        with use_container(b):
            assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
        assert get_mla_prefill_backend(CONFIG) is Mine
    assert get_mla_prefill_backend(CONFIG, container=a) is Mine
    try:
        set_default_container(a)
        assert get_mla_prefill_backend(CONFIG) is Mine
        set_default_container(b)
        assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
    finally:
        reset_default_container()
    assert get_container() is not a


def test_decode_is_kept_per_query_length() -> None:
    c = create_container(CONFIG, CpuPlatform())
    with use_container(c):
        first = get_mla_decode_backend(CONFIG, query_len=1)
        assert get_mla_decode_backend(CONFIG, query_len=2) is first
        c.mla_decode_backends().TORCH_SDPA.override(providers.Object(MyDecode))
        c.mla_decode_backends().CPU_MLA.override(providers.Object(MyDecode))
        assert get_mla_decode_backend(CONFIG, query_len=2) is MyDecode
        assert MLADecodeBackendEnum.TORCH_SDPA.get_class() is MyDecode


def test_the_kv_spec_facade_sees_registrations_and_provider_overrides() -> None:
    c = create_container(CONFIG, CpuPlatform())
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="fp16")
    with use_container(c):
        assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
        assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager

        class Sub(FullAttentionSpec):
            pass

        sub = Sub(block_size=16, num_kv_heads=1, head_size=8, dtype="fp16")
        assert KVCacheSpecRegistry.get_manager_class(sub) is FullAttentionManager
        KVCacheSpecRegistry.register(Sub, SlidingWindowManager, FullAttentionSpec)
        assert KVCacheSpecRegistry.get_manager_class(sub) is SlidingWindowManager
        mine = KVCacheSpecBindings()
        mine.register(Sub, FullAttentionManager, FullAttentionSpec)
        c.kv_cache_spec_bindings.override(providers.Object(mine))
        assert KVCacheSpecRegistry.get_manager_class(sub) is FullAttentionManager
        c.kv_cache_spec_bindings.reset_override()
        assert KVCacheSpecRegistry.get_manager_class(sub) is SlidingWindowManager
        c.kv_cache_spec_bindings.reset()  # a fresh singleton: the registration is gone
        assert KVCacheSpecRegistry.get_manager_class(sub) is FullAttentionManager
    with use_container(create_container(CONFIG, CpuPlatform())):
        assert KVCacheSpecRegistry.get_manager_class(sub) is FullAttentionManager


# --- taking registrations back (rollback_on_error) -------------------------------------------


def test_a_failed_block_runs_its_undos_newest_first_and_reraises() -> None:
    from app._container_state import record_undo, rollback_on_error

    done: list[str] = []
    record_undo(lambda: done.append("outside"))  # outside any block: not recorded
    with pytest.raises(RuntimeError, match="boom"), rollback_on_error():
        record_undo(lambda: done.append("first"))
        record_undo(lambda: done.append("second"))
        raise RuntimeError("boom")
    assert done == ["second", "first"]


def test_a_failing_undo_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    from app._container_state import record_undo, rollback_on_error

    done: list[str] = []

    def broken() -> None:
        raise OSError("cannot undo")

    with pytest.raises(KeyError), rollback_on_error():
        record_undo(lambda: done.append("first"))
        record_undo(broken)
        raise KeyError("x")
    assert done == ["first"]
    assert "could not undo a registration" in caplog.text


def test_a_nested_block_that_succeeds_is_undone_by_the_outer_failure() -> None:
    from app._container_state import record_undo, rollback_on_error, undo_suspended

    done: list[str] = []
    with pytest.raises(ValueError), rollback_on_error():
        with rollback_on_error():
            record_undo(lambda: done.append("inner"))
        with undo_suspended():
            record_undo(lambda: done.append("suspended"))
        raise ValueError("outer fails")
    assert done == ["inner"]
    with rollback_on_error():  # success: nothing is undone
        record_undo(lambda: done.append("kept"))
    assert done == ["inner"]
