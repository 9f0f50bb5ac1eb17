"""The container-backed spec registry: built-ins, MRO lookups, conflicts, hook, isolation."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import attrs
import pytest
import torch

from app.config import EngineConfig
from app.containers import Application, create_container, use_container
from app.kvcache import (
    ChunkedLocalAttentionManager,
    ChunkedLocalAttentionSpec,
    CrossAttentionManager,
    CrossAttentionSpec,
    FullAttentionManager,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVCacheSpecBindings,
    KVCacheSpecMetadata,
    KVCacheSpecRegistry,
    MambaManager,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionManager,
    SinkFullAttentionSpec,
    SlidingWindowManager,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    register_kv_cache_spec,
)
from app.platforms import CpuPlatform

ATTN: dict[str, Any] = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}


@attrs.frozen(kw_only=True)
class MyFullSpec(FullAttentionSpec):
    """An unregistered subclass of a built-in."""


@attrs.frozen(kw_only=True)
class Unrelated(KVCacheSpec):
    @property
    def page_size_bytes(self) -> int:
        return 64


class MyManager(FullAttentionManager):
    pass


BUILTINS = {
    FullAttentionSpec: (FullAttentionManager, FullAttentionSpec),
    MLAAttentionSpec: (FullAttentionManager, FullAttentionSpec),
    TQFullAttentionSpec: (FullAttentionManager, FullAttentionSpec),
    HiddenStateCacheSpec: (FullAttentionManager, FullAttentionSpec),
    SinkFullAttentionSpec: (SinkFullAttentionManager, FullAttentionSpec),
    SlidingWindowSpec: (SlidingWindowManager, SlidingWindowSpec),
    SlidingWindowMLASpec: (SlidingWindowManager, SlidingWindowMLASpec),
    ChunkedLocalAttentionSpec: (ChunkedLocalAttentionManager, ChunkedLocalAttentionSpec),
    CrossAttentionSpec: (CrossAttentionManager, CrossAttentionSpec),
    MambaSpec: (MambaManager, MambaSpec),
}


def test_builtins_are_registered_lazily(kv_container: Application) -> None:
    bindings = kv_container.kv_cache_spec_bindings()
    assert isinstance(bindings, KVCacheSpecBindings)
    assert not bindings._builtins_registered
    registered = KVCacheSpecRegistry.registered_specs()
    assert bindings._builtins_registered
    assert {cls: (m.manager_class, m.uniform_type_base_spec)
            for cls, m in registered.items()} == BUILTINS
    assert all(isinstance(m, KVCacheSpecMetadata) for m in registered.values())


@pytest.mark.parametrize("spec", [
    FullAttentionSpec(block_size=16, **ATTN),
    MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16),
    TQFullAttentionSpec(block_size=16, tq_slot_size=64, **ATTN),
    HiddenStateCacheSpec(block_size=16, head_size=64, dtype=torch.bfloat16),
    SinkFullAttentionSpec(block_size=16, sink_len=16, **ATTN),
    SlidingWindowSpec(block_size=16, sliding_window=64, **ATTN),
    SlidingWindowMLASpec(block_size=16, sliding_window=64, head_size=576, dtype=torch.bfloat16),
    ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64, **ATTN),
    CrossAttentionSpec(block_size=16, **ATTN),
    MambaSpec(block_size=16, shapes=[[4]], dtypes=["bf16"]),
], ids=lambda s: type(s).__name__)
def test_builtin_lookups(spec: KVCacheSpec) -> None:
    manager, base = BUILTINS[type(spec)]
    assert KVCacheSpecRegistry.get_manager_class(spec) is manager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is base
    bindings = KVCacheSpecRegistry.bindings()
    assert bindings.get_manager_class(spec) is manager
    assert bindings.get_uniform_type_base_spec(spec) is base


def test_unregistered_subclass_inherits_through_mro() -> None:
    spec = MyFullSpec(block_size=16, **ATTN)
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec
    assert KVCacheSpecRegistry.get_manager_class(Unrelated(block_size=16)) is None
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(Unrelated(block_size=16)) is None
    assert KVCacheSpecRegistry.get_metadata(MyFullSpec) == KVCacheSpecRegistry.get_metadata(
        FullAttentionSpec)


def test_registration_invalidates_the_per_type_cache() -> None:
    spec = MyFullSpec(block_size=16, **ATTN)
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager  # cached now
    KVCacheSpecRegistry.register(MyFullSpec, MyManager, FullAttentionSpec)
    assert KVCacheSpecRegistry.get_manager_class(spec) is MyManager
    assert KVCacheSpecRegistry.bindings().get_manager_class(spec) is MyManager


def test_register_defaults_base_to_itself_and_is_idempotent() -> None:
    KVCacheSpecRegistry.register(Unrelated, FullAttentionManager)
    KVCacheSpecRegistry.register(Unrelated, FullAttentionManager)  # same binding: no-op
    KVCacheSpecRegistry.register(Unrelated, FullAttentionManager, Unrelated)
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(Unrelated(block_size=16)) is Unrelated


def test_conflicts_raise_value_error() -> None:
    with pytest.raises(ValueError, match=r"Conflicting registration .* FullAttentionSpec"):
        KVCacheSpecRegistry.register(FullAttentionSpec, MyManager)
    KVCacheSpecRegistry.register(MyFullSpec, FullAttentionManager, FullAttentionSpec)
    with pytest.raises(ValueError, match="Conflicting"):
        KVCacheSpecRegistry.register(MyFullSpec, FullAttentionManager)  # other base (itself)
    with pytest.raises(ValueError, match="Conflicting"):
        KVCacheSpecRegistry.register(MyFullSpec, MyManager, FullAttentionSpec)


def test_missing_manager_and_wrong_base_raise_value_error() -> None:
    with pytest.raises(ValueError, match="manager_class is required"):
        KVCacheSpecRegistry.register(MyFullSpec, None)
    with pytest.raises(ValueError, match="must inherit from"):
        KVCacheSpecRegistry.register(MyFullSpec, FullAttentionManager, SlidingWindowSpec)
    with pytest.raises(ValueError, match="manager_class is required"):
        register_kv_cache_spec()
    with pytest.raises(TypeError):
        KVCacheSpecRegistry.register(int, FullAttentionManager)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KVCacheSpecRegistry.register(MyFullSpec, object)  # type: ignore[arg-type]


@pytest.mark.slow
def test_errors_hold_under_python_dash_o() -> None:
    code = (
        "from app.kvcache import KVCacheSpecRegistry, FullAttentionSpec, SlidingWindowManager\n"
        "try:\n"
        "    KVCacheSpecRegistry.register(FullAttentionSpec, SlidingWindowManager)\n"
        "except ValueError as e:\n"
        "    print('VALUEERROR', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert "VALUEERROR Conflicting registration" in out.stdout


def test_decorator_registers_in_the_active_container(kv_container: Application) -> None:
    @register_kv_cache_spec(manager_class=MyManager, uniform_type_base_spec=FullAttentionSpec)
    @attrs.frozen(kw_only=True)
    class Decorated(FullAttentionSpec):
        pass

    spec = Decorated(block_size=16, **ATTN)
    assert KVCacheSpecRegistry.get_manager_class(spec) is MyManager
    with use_container(create_container(platform=CpuPlatform())):
        # Another container never saw the decorator: MRO falls back to FullAttentionSpec.
        assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
    assert KVCacheSpecRegistry.get_manager_class(spec) is MyManager


def test_check_registry_names_every_unregistered_layer() -> None:
    @attrs.frozen(kw_only=True)
    class Other(KVCacheSpec):
        @property
        def page_size_bytes(self) -> int:
            return 1

    specs: dict[str, KVCacheSpec] = {
        "layers.0": FullAttentionSpec(block_size=16, **ATTN),
        "layers.1": Unrelated(block_size=16),
        "layers.2": MyFullSpec(block_size=16, **ATTN),  # registered through its parent
        "layers.3": Other(block_size=16),
    }
    with pytest.raises(ValueError) as info:
        KVCacheSpecRegistry.check_kv_cache_spec_registry(specs)
    message = str(info.value)
    assert "Unsupported KV cache spec type for layer layers.1:" in message
    assert "Unsupported KV cache spec type for layer layers.3:" in message
    assert "layers.0" not in message and "layers.2" not in message
    assert "Unrelated" in message and "Other" in message
    KVCacheSpecRegistry.check_kv_cache_spec_registry({"a": specs["layers.0"]})


def test_isolation_across_containers() -> None:
    c1 = create_container(platform=CpuPlatform())
    c2 = create_container(platform=CpuPlatform())
    with use_container(c1):
        KVCacheSpecRegistry.register(Unrelated, MyManager)
        assert KVCacheSpecRegistry.get_manager_class(Unrelated(block_size=16)) is MyManager
    with use_container(c2):
        assert KVCacheSpecRegistry.get_manager_class(Unrelated(block_size=16)) is None
        KVCacheSpecRegistry.register(Unrelated, FullAttentionManager)  # no conflict here
    with use_container(c1):
        assert KVCacheSpecRegistry.get_manager_class(Unrelated(block_size=16)) is MyManager
    assert c1.kv_cache_spec_bindings() is not c2.kv_cache_spec_bindings()
    # The test's own container saw none of it.
    assert KVCacheSpecRegistry.get_manager_class(Unrelated(block_size=16)) is None


@attrs.frozen(kw_only=True)
class VendorSpec(FullAttentionSpec):
    """A platform's own spec kind."""


class VendorPlatform(CpuPlatform):
    name = "vendor"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def register_custom_kv_cache_specs(self, registry: Any, config: EngineConfig | None) -> None:
        self.calls.append((registry, config))
        # Built-ins are already there when the hook runs.
        assert registry.get_manager_class(FullAttentionSpec(block_size=16, **ATTN)) is not None
        registry.register(VendorSpec, MyManager, FullAttentionSpec)


def test_platform_hook_runs_once_per_container_after_builtins() -> None:
    platform = VendorPlatform()
    config = EngineConfig.from_dict({"cache": {"block_size": 32}})
    container = create_container(config, platform=platform)
    with use_container(container):
        spec = VendorSpec(block_size=16, **ATTN)
        assert KVCacheSpecRegistry.get_manager_class(spec) is MyManager
        KVCacheSpecRegistry.register(Unrelated, FullAttentionManager)
        KVCacheSpecRegistry.check_kv_cache_spec_registry({"a": spec})
        assert KVCacheSpecRegistry.get_manager_class(spec) is MyManager
    assert len(platform.calls) == 1
    registry, seen_config = platform.calls[0]
    assert registry is container.kv_cache_spec_bindings()
    assert seen_config is config
    # A second container with the same platform runs the hook again, once.
    with use_container(create_container(config, platform=platform)):
        KVCacheSpecRegistry.get_manager_class(spec)
        KVCacheSpecRegistry.get_manager_class(spec)
    assert len(platform.calls) == 2


def test_bindings_used_directly_run_the_hook_in_their_container() -> None:
    platform = VendorPlatform()
    container = create_container(platform=platform)
    with use_container(container):
        bindings = container.kv_cache_spec_bindings()
        assert bindings.get_manager_class(VendorSpec(block_size=16, **ATTN)) is MyManager
    assert len(platform.calls) == 1 and bindings.hook_ran


def test_bindings_of_an_inactive_container_get_its_platform() -> None:
    platform = VendorPlatform()
    container = create_container(platform=platform)
    bindings = container.kv_cache_spec_bindings()  # used while another container is active
    spec = VendorSpec(block_size=16, **ATTN)
    assert bindings.get_manager_class(spec) is MyManager  # the provider passed the platform
    assert len(platform.calls) == 1
    with use_container(container):
        assert KVCacheSpecRegistry.get_manager_class(spec) is MyManager
    assert len(platform.calls) == 1


def test_standalone_bindings_skip_the_hook() -> None:
    bindings = KVCacheSpecBindings(platform=None)
    assert bindings.get_manager_class(FullAttentionSpec(block_size=16, **ATTN)) \
        is FullAttentionManager
    assert not bindings.hook_ran
    platform = VendorPlatform()
    explicit = KVCacheSpecBindings(platform=platform, config=None)
    assert explicit.get_manager_class(VendorSpec(block_size=16, **ATTN)) is MyManager
    assert platform.calls == [(explicit, None)]
    assert VendorSpec in explicit and repr(explicit).startswith("KVCacheSpecBindings(")


def test_hook_may_look_up_and_register_reentrantly() -> None:
    class Reentrant(CpuPlatform):
        def register_custom_kv_cache_specs(self, registry: Any, config: Any) -> None:
            KVCacheSpecRegistry.register(VendorSpec, MyManager, FullAttentionSpec)
            assert KVCacheSpecRegistry.get_manager_class(
                VendorSpec(block_size=16, **ATTN)) is MyManager

    with use_container(create_container(platform=Reentrant())):
        assert KVCacheSpecRegistry.get_manager_class(
            VendorSpec(block_size=16, **ATTN)) is MyManager


@attrs.frozen(kw_only=True)
class HalfSpec(FullAttentionSpec):
    """Registered by a hook that then fails."""


class FailingPlatform(CpuPlatform):
    """Its hook registers ``HalfSpec`` and raises on its first ``fail`` runs; later runs
    register ``VendorSpec``."""

    name = "failing"

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.runs = 0

    def register_custom_kv_cache_specs(self, registry: Any, config: EngineConfig | None) -> None:
        self.runs += 1
        if self.runs <= self.fail:
            registry.register(HalfSpec, FullAttentionManager, FullAttentionSpec)
            raise ValueError("hook failed half-way")
        registry.register(VendorSpec, MyManager, FullAttentionSpec)


def test_a_failing_hook_is_rolled_back_and_runs_again() -> None:
    # It left HalfSpec registered and counted as run: the second lookup returned normally,
    # without what the hook would have registered after, and the hook never ran again.
    platform = FailingPlatform(fail=2)
    bindings = create_container(EngineConfig(), platform=platform).kv_cache_spec_bindings()
    for runs in (1, 2):
        with pytest.raises(ValueError, match="hook failed half-way"):
            bindings.get_metadata(FullAttentionSpec)
        assert platform.runs == runs and not bindings.hook_ran
    meta = bindings.get_metadata(HalfSpec)
    assert meta is not None and meta.kv_cache_spec_cls is FullAttentionSpec  # not registered
    assert HalfSpec not in bindings and VendorSpec in bindings
    assert bindings.hook_ran and platform.runs == 3
    assert bindings.get_manager_class(VendorSpec(block_size=16, **ATTN)) is MyManager
