"""Guard against drift from the seeds: every call vLLM's documents show (``/work/shared/seeds``:
the MLA prefill registry and its decorator, the enum's methods, the selector, the KV-cache spec
registry, the uniformity rule and the platform hook), made with the documents' own signatures
and argument forms, by code written as a third party following them would write it."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import pytest
import torch

from app.backends import (
    MLAPrefillBackend,
    MLAPrefillBackendEnum,
    get_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.decode.base import MLADecodeBackend
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.config import EngineConfig
from app.containers import Application, create_container, use_container
from app.kvcache import (
    AttentionSpec,
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecRegistry,
    MLAAttentionSpec,
    SlidingWindowManager,
    SlidingWindowSpec,
    get_kv_cache_groups,
    register_kv_cache_spec,
)
from app.platforms import CpuPlatform

# -- what a third party writes, as the seeds show it ----------------------------------------


class SeedStyleBackend(MLAPrefillBackend):
    """A backend written as 003 shows the base: ``get_name`` a staticmethod, the capability
    and availability classmethods overridden, the run methods with the seed's parameters."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "SEED_STYLE"

    @classmethod
    def supports_compute_capability(cls, device_capability: Any) -> bool:
        return True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def run_prefill_context_chunk(self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class OtherSeedStyleBackend(SeedStyleBackend):
    """A second class for the decorator forms."""


@pytest.fixture
def seed_container() -> Iterator[Application]:
    """A fresh container on a CPU, active for the test."""
    container = create_container(platform=CpuPlatform())
    with use_container(container):
        yield container


# -- 000 / 001: the registry, its enum and the decorator -------------------------------------


def test_the_enum_holds_vllms_members_and_custom_is_none() -> None:
    for name in ("FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TOKENSPEED_MLA"):
        assert isinstance(MLAPrefillBackendEnum[name].value, str)
    assert MLAPrefillBackendEnum.CUSTOM.value is None
    assert all(MLAPrefillBackendEnum.CUSTOM is not m for m in MLAPrefillBackendEnum
               if m.name != "CUSTOM")


def test_an_unknown_member_is_vllms_value_error() -> None:
    with pytest.raises(ValueError, match=r"^Unknown MLA prefill backend: 'NOPE'\. "
                                         r"Valid options are: .*CUSTOM"):
        MLAPrefillBackendEnum["NOPE"]


def test_get_path_get_class_is_overridden_clear_override(seed_container: Application) -> None:
    member = MLAPrefillBackendEnum.FLASH_ATTN
    assert member.get_path() == member.value and not member.is_overridden()
    with pytest.raises(ValueError, match=r"MLA prefill backend CUSTOM must be registered before "
                                         r"use.*register_mla_prefill_backend\("
                                         r"MLAPrefillBackendEnum\.CUSTOM, "
                                         r"'your\.module\.YourClass'\)"):
        MLAPrefillBackendEnum.CUSTOM.get_path()
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, f"{__name__}.SeedStyleBackend")
    assert MLAPrefillBackendEnum.CUSTOM.get_path() == f"{__name__}.SeedStyleBackend"
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is SeedStyleBackend
    assert MLAPrefillBackendEnum.CUSTOM.is_overridden()
    assert MLAPrefillBackendEnum.CUSTOM.clear_override() is None
    assert not MLAPrefillBackendEnum.CUSTOM.is_overridden()


def test_get_class_raises_import_error_for_a_path_that_does_not_import(
        seed_container: Application) -> None:
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "no.such.module.Backend")
    with pytest.raises(ImportError):
        MLAPrefillBackendEnum.CUSTOM.get_class()


def test_the_three_registration_forms_of_the_docstring(seed_container: Application) -> None:
    # Override an existing MLA prefill backend
    @register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN)
    class MyCustomFlashAttn(SeedStyleBackend):
        ...

    # Register a custom third-party MLA prefill backend
    @register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM)
    class MyCustomPrefillBackend(SeedStyleBackend):
        ...

    assert MLAPrefillBackendEnum.FLASH_ATTN.get_class() is MyCustomFlashAttn
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is MyCustomPrefillBackend
    # the decorator records the class's qualified name, as 000 shows
    assert MLAPrefillBackendEnum.CUSTOM.get_path() == (
        f"{MyCustomPrefillBackend.__module__}.{MyCustomPrefillBackend.__qualname__}")
    # Direct registration (positional, and by keyword), returning a no-op decorator
    no_op = register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM,
                                         f"{__name__}.OtherSeedStyleBackend")
    assert no_op(int) is int
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is OtherSeedStyleBackend
    register_mla_prefill_backend(backend=MLAPrefillBackendEnum.CUSTOM,
                                 class_path=f"{__name__}.SeedStyleBackend")
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is SeedStyleBackend


def test_the_signatures_are_the_seeds() -> None:
    """The parameters 001 and 003 document, by name and default."""
    register = inspect.signature(register_mla_prefill_backend).parameters
    assert list(register) == ["backend", "class_path"] and register["class_path"].default is None
    for method in ("get_path", "get_class", "is_overridden", "clear_override"):
        assert list(inspect.signature(getattr(MLAPrefillBackendEnum.CUSTOM, method)).parameters) \
            == []
    assert list(inspect.signature(MLAPrefillBackend.validate_configuration).parameters) == [
        "device_capability", "selector_config"]
    init = list(inspect.signature(MLAPrefillBackend.__init__).parameters)
    assert init[:7] == ["self", "num_heads", "scale", "kv_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim"]
    assert list(inspect.signature(MLAPrefillBackend.run_prefill_new_tokens).parameters)[:5] == [
        "self", "q", "k", "v", "return_softmax_lse"]
    assert list(inspect.signature(MLAPrefillBackend.run_prefill_context_chunk).parameters)[
        1:5] == ["chunk", "q", "k", "v"]


# -- 003: the base class's declarations and the selector -------------------------------------


def test_the_base_class_declarations_of_003() -> None:
    from app._types import DeviceCapability
    from app.backends.prefill.base import MLAPrefillSelectorConfig

    config = MLAPrefillSelectorConfig.from_engine_config(EngineConfig())
    assert SeedStyleBackend.get_name() == "SEED_STYLE"
    assert SeedStyleBackend.supports_dtype(torch.bfloat16)
    assert not SeedStyleBackend.supports_dtype(torch.float32)
    assert SeedStyleBackend.validate_configuration(DeviceCapability(9, 0), config) == []

    class NeedsR1(SeedStyleBackend):
        requires_r1_mla_dimensions = True

    odd = MLAPrefillSelectorConfig.from_engine_config(EngineConfig.from_dict(
        {"model": {"qk_nope_head_dim": 64}}))
    assert NeedsR1.validate_configuration(DeviceCapability(9, 0), config) == []
    assert len(NeedsR1.validate_configuration(DeviceCapability(9, 0), odd)) == 1


def test_get_mla_prefill_backend_with_a_config(seed_container: Application) -> None:
    """``get_mla_prefill_backend(vllm_config)``: the config's forced backend (an enum member,
    as ``attention_config.mla_prefill_backend`` holds it) or the platform's first valid one."""
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, SeedStyleBackend)
    forced = EngineConfig.from_dict({"attention": {
        "mla_prefill_backend": MLAPrefillBackendEnum.CUSTOM}})
    assert get_mla_prefill_backend(forced) is SeedStyleBackend
    assert get_mla_prefill_backend(EngineConfig()) is TorchSDPABackend
    invalid = EngineConfig.from_dict({"attention": {"mla_prefill_backend": "FLASH_ATTN"}})
    with pytest.raises(ValueError, match=r"^Selected MLA prefill backend FLASH_ATTN is not "
                                         r"valid for this configuration\. Reason: \["):
        get_mla_prefill_backend(invalid)


def test_an_unknown_backend_name_is_rejected_when_the_config_is_built() -> None:
    from app.config import AttentionConfig

    with pytest.raises(ValueError, match="Unknown MLA prefill backend: 'NONEXISTENT'"):
        AttentionConfig(mla_prefill_backend="NONEXISTENT")
    with pytest.raises(ValueError, match="Unknown MLA prefill backend: 'NONEXISTENT'"):
        EngineConfig.from_dict({"attention": {"mla_prefill_backend": "NONEXISTENT"}})


# -- 004: the KV-cache spec registry, the uniformity rule and the platform hook ---------------


@attrs.frozen(kw_only=True)
class WindowedSpec(AttentionSpec):
    """A third party's spec overriding the uniformity rule with 004's one-argument signature."""

    window: int = 8

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        return self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(isinstance(spec, WindowedSpec) and spec.window == self.window
                   for spec in kv_cache_specs.values())


def _attn(**extra: Any) -> dict[str, Any]:
    return {"block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": torch.float16,
            **extra}


def test_kv_cache_spec_registry_classmethods(seed_container: Application) -> None:
    KVCacheSpecRegistry.register(WindowedSpec, SlidingWindowManager,
                                 uniform_type_base_spec=WindowedSpec)
    spec = WindowedSpec(**_attn())
    assert KVCacheSpecRegistry.get_manager_class(spec) is SlidingWindowManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is WindowedSpec
    KVCacheSpecRegistry.check_kv_cache_spec_registry({"layer.0": spec})
    with pytest.raises(ValueError, match=r"layer\.1"):
        KVCacheSpecRegistry.check_kv_cache_spec_registry({"layer.1": object()})  # type: ignore[dict-item]


def test_register_kv_cache_spec_decorator(seed_container: Application) -> None:
    @register_kv_cache_spec(manager_class=FullAttentionManager,
                            uniform_type_base_spec=FullAttentionSpec)
    @attrs.frozen(kw_only=True)
    class TQLikeSpec(FullAttentionSpec):
        pass

    spec = TQLikeSpec(**_attn())
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
    assert FullAttentionSpec(**_attn()).is_uniform_with_collection({"a": spec})


def test_is_uniform_with_collection_takes_the_specs_alone(seed_container: Application) -> None:
    """004's signature, ``is_uniform_with_collection(kv_cache_specs)``, on every built-in (the
    active container's bindings by default) and on a third party's override, including inside
    grouping; explicit bindings stay possible."""
    full, mla = FullAttentionSpec(**_attn()), MLAAttentionSpec(block_size=16, head_size=64,
                                                               dtype=torch.float16)
    sw = SlidingWindowSpec(**_attn(sliding_window=128))
    assert full.is_uniform_with_collection({"a": full, "b": mla})
    assert not full.is_uniform_with_collection({"a": full, "b": sw})
    assert sw.is_uniform_with_collection({"a": sw})
    assert not sw.is_uniform_with_collection({"a": SlidingWindowSpec(
        **_attn(sliding_window=256))})
    assert full.is_uniform_with_collection({"a": mla}, KVCacheSpecRegistry.bindings())
    KVCacheSpecRegistry.register(WindowedSpec, SlidingWindowManager)
    a, b = WindowedSpec(**_attn()), WindowedSpec(**_attn(window=4))
    assert a.is_uniform_with_collection({"x": a}) and not a.is_uniform_with_collection({"y": b})
    bindings = KVCacheSpecRegistry.bindings()
    assert [g.layer_names for g in get_kv_cache_groups({"x": a, "z": a}, bindings)] == [
        ("x", "z")]
    assert sorted(g.layer_names for g in get_kv_cache_groups({"x": a, "y": b}, bindings)) == [
        ("x",), ("y",)]


def test_the_one_argument_form_follows_the_active_container() -> None:
    """Registered in one container only: the default bindings are the active container's."""
    mine, other = create_container(platform=CpuPlatform()), create_container(
        platform=CpuPlatform())
    with use_container(mine):
        KVCacheSpecRegistry.register(WindowedSpec, SlidingWindowManager)

    @attrs.frozen(kw_only=True)
    class Child(WindowedSpec):
        def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
            return KVCacheSpec.is_uniform_with_collection(self, kv_cache_specs)

    spec = Child(**_attn())
    with use_container(mine):
        assert spec.is_uniform_with_collection({"a": spec})
    with use_container(other), pytest.raises(ValueError, match="Unsupported KV cache spec"):
        spec.is_uniform_with_collection({"a": spec})


def test_a_platform_hook_written_as_vllms(seed_container: Application) -> None:
    """004: a platform overrides ``register_custom_kv_cache_specs`` (vLLM's classmethod taking
    the config) and registers through ``KVCacheSpecRegistry``; it runs once per container and
    its spec is bound there only."""
    calls: list[object] = []

    class HookPlatform(CpuPlatform):
        @classmethod
        def register_custom_kv_cache_specs(cls, vllm_config: Any) -> None:  # type: ignore[override]
            calls.append(vllm_config)
            KVCacheSpecRegistry.register(WindowedSpec, SlidingWindowManager,
                                         uniform_type_base_spec=WindowedSpec)

    config = EngineConfig()
    container = create_container(config, HookPlatform())
    spec = WindowedSpec(**_attn())
    with use_container(container):
        assert KVCacheSpecRegistry.get_manager_class(spec) is SlidingWindowManager
        assert KVCacheSpecRegistry.get_manager_class(spec) is SlidingWindowManager
    assert calls == [config]
    assert KVCacheSpecRegistry.get_manager_class(spec) is None  # the fixture's container


def test_decode_names_are_checked_the_same_way() -> None:
    """The decode twin of the registry follows the same forms (``register_mla_decode_backend``
    with a member, a path or as a decorator)."""
    from app.backends import MLADecodeBackendEnum, register_mla_decode_backend
    from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend

    with use_container(create_container(platform=CpuPlatform())):
        register_mla_decode_backend(MLADecodeBackendEnum.CUSTOM,
                                    "app.backends.decode.torch_sdpa.TorchSDPADecodeBackend")
        assert MLADecodeBackendEnum.CUSTOM.get_class() is TorchSDPADecodeBackend
        name = f"SEED_DECODE_{uuid.uuid4().hex[:8].upper()}"

        @register_mla_decode_backend(name)
        class Mine(TorchSDPADecodeBackend):
            pass

        assert MLADecodeBackendEnum[name].get_class() is Mine
        assert issubclass(Mine, MLADecodeBackend)


@pytest.mark.parametrize("call", [
    "get_mla_prefill_backend", "explain_mla_prefill_selection", "get_mla_decode_backend",
    "explain_mla_decode_selection"])
@pytest.mark.parametrize(("kwargs", "what"), [
    ({"config": 3}, r"config must be an EngineConfig or None .*got 3 \(int\)"),
    ({"config": {"attention": {}}},
     r"config must be an EngineConfig or None .*got \{'attention': \{\}\} \(dict\)"),
    ({"container": 3}, r"container: expected an app\.containers\.Application instance, "
                       r"got 3 \(int\)"),
])
def test_the_selectors_refuse_wrong_argument_types(seed_container: Application, call: str,
                                                   kwargs: dict[str, Any], what: str) -> None:
    import app.backends

    selector = getattr(app.backends, call)
    with pytest.raises(TypeError, match=rf"^{call}: {what}"):
        selector(**kwargs)
    if "config" in kwargs:  # positionally too, as the seeds call it
        with pytest.raises(TypeError, match=rf"^{call}: {what}"):
            selector(kwargs["config"])
