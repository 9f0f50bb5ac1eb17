"""The MLA prefill backend selector: platform priorities, validation, errors, caching."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from dependency_injector import providers

from app.backends import (
    DeviceCapability,
    MLADimensions,
    MLAPrefillBackend,
    MLAPrefillBackendEnum,
    MLAPrefillSelectorConfig,
    explain_mla_prefill_selection,
    get_mla_prefill_backend,
    override_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.config import EngineConfig
from app.containers import Application, create_container, get_container, use_container
from app.platforms import TRTLLM_PREFERRED_DIMENSIONS, CpuPlatform, CudaPlatform, Platform
from app.testing import SelectionOnlyBackend

BUILTINS = ["TORCH_SDPA", "FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TOKENSPEED_MLA",
            "TORCH_SPARSE", "CPU_MLA_SPARSE"]
DEEPSEEK = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


class Stub(SelectionOnlyBackend):
    """Valid everywhere; counts how often it is validated."""

    validations: ClassVar[int] = 0

    @staticmethod
    def get_name() -> str:
        return "STUB"

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLAPrefillSelectorConfig) -> list[str]:
        Stub.validations += 1
        return super().validate_configuration(device_capability, selector_config)



class Valid(Stub):
    pass


class AlsoValid(Stub):
    pass


class Unavailable(Stub):
    @classmethod
    def is_available(cls) -> bool:
        return False


class NeedsGPU(Stub):
    requires_device_capability = True

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability) -> bool:
        return device_capability.major >= 9


class HalfOnly(Stub):
    supported_dtypes = (torch.float16,)


class TrtllmDims(Stub):
    supported_mla_dimensions = (TRTLLM_PREFERRED_DIMENSIONS,)


class NotABackend:
    pass


def cuda(major: int, minor: int = 0) -> CudaPlatform:
    return CudaPlatform(device_capability=DeviceCapability(major, minor))


def engine_config(backend: str | None = None, dtype: str = "bfloat16",
                  dims: MLADimensions = DEEPSEEK) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"dtype": dtype, "qk_nope_head_dim": dims.qk_nope_head_dim,
                  "qk_rope_head_dim": dims.qk_rope_head_dim, "v_head_dim": dims.v_head_dim},
        "attention": {"mla_prefill_backend": backend}})


@pytest.fixture
def stubbed(app_container: Application) -> Iterator[Callable[..., None]]:
    """``stubbed(platform, NAME=cls, ...)``: the test's container on ``platform`` with the named
    built-ins replaced (the rest unavailable)."""
    scopes: list[Any] = []

    def apply(platform: Platform, **classes: type[MLAPrefillBackend] | str) -> None:
        app_container.platform.override(providers.Object(platform))
        for name in BUILTINS:
            scope = override_mla_prefill_backend(MLAPrefillBackendEnum[name],
                                                 classes.get(name, Unavailable))
            scope.__enter__()
            scopes.append(scope)

    yield apply
    for scope in reversed(scopes):
        scope.__exit__(None, None, None)


# --- platform priorities -------------------------------------------------------------------


def _priorities(platform: Platform, dims: MLADimensions = DEEPSEEK) -> list[str]:
    return platform.mla_prefill_backend_priorities(
        MLAPrefillSelectorConfig(dtype=torch.bfloat16, mla_dimensions=dims))


def test_cpu_priorities() -> None:
    assert _priorities(CpuPlatform()) == ["TORCH_SDPA"]
    assert _priorities(CpuPlatform(), TRTLLM_PREFERRED_DIMENSIONS) == ["TORCH_SDPA"]


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (12, 0)])
def test_older_and_other_gpus_priorities(cap: tuple[int, int]) -> None:
    assert _priorities(cuda(*cap)) == ["FLASH_ATTN", "TORCH_SDPA"]


def test_sm90_priorities() -> None:
    assert _priorities(cuda(9, 0)) == ["FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]
    assert _priorities(cuda(9, 0), TRTLLM_PREFERRED_DIMENSIONS) == [
        "FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]


@pytest.mark.parametrize("cap", [(10, 0), (10, 3), (10, 7)])
def test_sm100_family_priorities(cap: tuple[int, int]) -> None:
    assert _priorities(cuda(*cap)) == [
        "FLASH_ATTN", "TRTLLM_RAGGED", "FLASHINFER", "TOKENSPEED_MLA", "TORCH_SDPA"]
    assert MLADimensions(192, 64, 256) == TRTLLM_PREFERRED_DIMENSIONS
    assert _priorities(cuda(*cap), TRTLLM_PREFERRED_DIMENSIONS) == [
        "TRTLLM_RAGGED", "FLASH_ATTN", "FLASHINFER", "TOKENSPEED_MLA", "TORCH_SDPA"]


# --- automatic selection -------------------------------------------------------------------


def test_cpu_selects_torch_sdpa(stubbed: Callable[..., None]) -> None:
    stubbed(CpuPlatform(), TORCH_SDPA=Valid, FLASH_ATTN=AlsoValid)
    assert get_mla_prefill_backend(engine_config()) is Valid


def test_first_valid_in_priority_order(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(10, 0), FLASHINFER=Valid, TOKENSPEED_MLA=AlsoValid, TORCH_SDPA=AlsoValid)
    assert get_mla_prefill_backend(engine_config()) is Valid


def test_trtllm_first_for_its_dimensions(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(10, 0), FLASH_ATTN=Valid, TRTLLM_RAGGED=TrtllmDims)
    assert get_mla_prefill_backend(engine_config(dims=TRTLLM_PREFERRED_DIMENSIONS)) is TrtllmDims
    assert get_mla_prefill_backend(engine_config()) is Valid


def test_sm90_skips_blackwell_only_backends(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), TRTLLM_RAGGED=Valid, TOKENSPEED_MLA=Valid, TORCH_SDPA=AlsoValid)
    assert get_mla_prefill_backend(engine_config()) is AlsoValid


def test_import_error_counts_as_a_reason(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASH_ATTN="no.such.module.FlashAttn", FLASHINFER=Valid)
    assert get_mla_prefill_backend(engine_config()) is Valid
    explanation = explain_mla_prefill_selection(engine_config())
    reasons = explanation["backends"]["FLASH_ATTN"]["reasons"]
    assert len(reasons) == 1 and reasons[0].startswith("ImportError:")
    assert "no.such.module" in reasons[0]


def test_none_valid_lists_every_reason(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASH_ATTN=HalfOnly, FLASHINFER="no.such.module.Cls",
            TORCH_SDPA=Unavailable)
    config = engine_config(dtype="float32")
    with pytest.raises(ValueError) as info:
        get_mla_prefill_backend(config)
    message = str(info.value)
    selector_config = MLAPrefillSelectorConfig.from_engine_config(config)
    assert message.startswith(f"No valid MLA prefill backend found with {selector_config!r}")
    assert "Reasons: {FLASH_ATTN: [dtype torch.float32 not supported], FLASHINFER: " \
           "[ImportError: " in message
    assert message.endswith("TORCH_SDPA: [dtype torch.float32 not supported, "
                            "required dependencies not available]}.")


def test_reasons_come_in_a_fixed_order(stubbed: Callable[..., None]) -> None:
    class Everything(Stub):
        requires_device_capability = True
        supported_dtypes = (torch.float16,)
        supported_mla_dimensions = (TRTLLM_PREFERRED_DIMENSIONS,)

        @classmethod
        def is_available(cls) -> bool:
            return False

    stubbed(CpuPlatform(), TORCH_SDPA=Everything)
    reasons = explain_mla_prefill_selection(engine_config())["backends"]["TORCH_SDPA"]["reasons"]
    assert reasons[:3] == ["device capability not available", "dtype torch.bfloat16 not supported",
                           "required dependencies not available"]
    assert reasons[3].startswith("Model does not have supported MLA dimensions (got ")


def test_a_platform_may_change_the_list(app_container: Application) -> None:
    class CustomFirst(CpuPlatform):
        def mla_prefill_backend_priorities(self, selector_config: Any) -> list[str]:
            return ["CUSTOM", "NOT_A_BACKEND", "TORCH_SDPA"]

    app_container.platform.override(providers.Object(CustomFirst()))
    with override_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, AlsoValid):
        assert get_mla_prefill_backend(engine_config()) is AlsoValid  # CUSTOM unregistered
        explanation = explain_mla_prefill_selection(engine_config())
        assert "must be registered before use" in explanation["backends"]["CUSTOM"]["reasons"][0]
        assert explanation["backends"]["NOT_A_BACKEND"]["reasons"] == [
            "unknown MLA prefill backend 'NOT_A_BACKEND'"]
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Valid)
        assert get_mla_prefill_backend(engine_config()) is Valid


def test_a_non_backend_class_is_a_reason_not_a_crash(stubbed: Callable[..., None],
                                                     app_container: Application) -> None:
    stubbed(cuda(9, 0), TORCH_SDPA=Valid)
    app_container.mla_prefill_backends.FLASH_ATTN.override(providers.Object(NotABackend))
    assert get_mla_prefill_backend(engine_config()) is Valid
    reasons = explain_mla_prefill_selection()["backends"]["FLASH_ATTN"]["reasons"]
    assert reasons[0].startswith("TypeError:")


def test_a_validate_configuration_that_raises_is_a_reason_not_a_crash(
        stubbed: Callable[..., None]) -> None:
    class Crashes(Stub):
        @classmethod
        def validate_configuration(cls, device_capability: DeviceCapability | None,
                                   selector_config: MLAPrefillSelectorConfig) -> list[str]:
            raise RuntimeError("kernel table\nmissing")

    stubbed(cuda(9, 0), FLASH_ATTN=Crashes, FLASHINFER=Valid)
    assert get_mla_prefill_backend(engine_config()) is Valid
    reasons = explain_mla_prefill_selection()["backends"]["FLASH_ATTN"]["reasons"]
    assert reasons == ["RuntimeError: kernel table missing"]


# --- explicit backends ---------------------------------------------------------------------


def test_explicit_backend_is_used_even_if_not_first(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(10, 0), FLASH_ATTN=Valid, TOKENSPEED_MLA=AlsoValid)
    assert get_mla_prefill_backend(engine_config("TOKENSPEED_MLA")) is AlsoValid


def test_explicit_backend_outside_the_priority_list(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(8, 0), FLASH_ATTN=Valid, TRTLLM_RAGGED=AlsoValid)
    assert get_mla_prefill_backend(engine_config("TRTLLM_RAGGED")) is AlsoValid


def test_explicit_invalid_backend_message(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASHINFER=HalfOnly, TORCH_SDPA=Valid)
    with pytest.raises(ValueError) as info:
        get_mla_prefill_backend(engine_config("FLASHINFER"))
    assert str(info.value) == ("Selected MLA prefill backend FLASHINFER is not valid for this "
                               "configuration. Reason: ['dtype torch.bfloat16 not supported']")


def test_explicit_backend_that_does_not_import(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASHINFER="no.such.module.Cls")
    with pytest.raises(ValueError, match=r"Selected MLA prefill backend FLASHINFER is not "
                                         r"valid for this configuration\. Reason: "
                                         r"\[.ImportError: "):
        get_mla_prefill_backend(engine_config("FLASHINFER"))


def test_explicit_backend_needing_a_gpu_on_a_cpu(stubbed: Callable[..., None]) -> None:
    stubbed(CpuPlatform(), FLASH_ATTN=NeedsGPU, TORCH_SDPA=Valid)
    with pytest.raises(ValueError, match=r"Reason: \['device capability not available'\]"):
        get_mla_prefill_backend(engine_config("FLASH_ATTN"))
    stubbed(cuda(8, 0), FLASH_ATTN=NeedsGPU)
    with pytest.raises(ValueError, match=r"Reason: \['compute capability 8\.0 not supported'\]"):
        get_mla_prefill_backend(engine_config("FLASH_ATTN"))
    stubbed(cuda(9, 0), FLASH_ATTN=NeedsGPU)
    assert get_mla_prefill_backend(engine_config("FLASH_ATTN")) is NeedsGPU


def test_explicit_custom_must_be_registered(app_container: Application) -> None:
    with pytest.raises(ValueError, match=r"Selected MLA prefill backend CUSTOM is not valid.*"
                                         r"must be registered before use"):
        get_mla_prefill_backend(engine_config("CUSTOM"))
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Valid)
    assert get_mla_prefill_backend(engine_config("CUSTOM")) is Valid


# --- the cache -----------------------------------------------------------------------------


def test_cached_selection_does_not_validate_again(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(10, 0), FLASHINFER=Valid)
    config = engine_config()
    assert get_mla_prefill_backend(config) is Valid
    before = Stub.validations
    for _ in range(5):
        assert get_mla_prefill_backend(config) is Valid
    assert get_mla_prefill_backend(engine_config()) is Valid  # equal, not identical
    assert Stub.validations == before
    assert get_container().selection_cache().misses == 1


def test_cache_sees_a_new_override(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASH_ATTN=Unavailable, FLASHINFER=Valid)
    config = engine_config()
    assert get_mla_prefill_backend(config) is Valid
    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN, AlsoValid)
    assert get_mla_prefill_backend(config) is AlsoValid
    MLAPrefillBackendEnum.FLASH_ATTN.clear_override()
    # Back to the default class (which may or may not import here): never the stale AlsoValid.
    assert get_mla_prefill_backend(config) is not AlsoValid


def test_cache_sees_clear_override(app_container: Application) -> None:
    app_container.platform.override(providers.Object(CpuPlatform()))
    config = engine_config("CUSTOM")
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Valid)
    assert get_mla_prefill_backend(config) is Valid
    MLAPrefillBackendEnum.CUSTOM.clear_override()
    with pytest.raises(ValueError, match="must be registered before use"):
        get_mla_prefill_backend(config)


def test_cache_sees_scoped_overrides(stubbed: Callable[..., None]) -> None:
    stubbed(CpuPlatform(), TORCH_SDPA=Valid)
    config = engine_config()
    assert get_mla_prefill_backend(config) is Valid
    with override_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, AlsoValid):
        assert get_mla_prefill_backend(config) is AlsoValid
    assert get_mla_prefill_backend(config) is Valid


def test_cache_sees_direct_provider_overrides(stubbed: Callable[..., None],
                                             app_container: Application) -> None:
    stubbed(CpuPlatform(), TORCH_SDPA=Valid)
    config = engine_config()
    assert get_mla_prefill_backend(config) is Valid
    with app_container.mla_prefill_backends.TORCH_SDPA.override(providers.Object(AlsoValid)):
        assert get_mla_prefill_backend(config) is AlsoValid
    assert get_mla_prefill_backend(config) is Valid


def test_cache_sees_a_platform_change(stubbed: Callable[..., None],
                                      app_container: Application) -> None:
    stubbed(cuda(9, 0), FLASH_ATTN=NeedsGPU, TORCH_SDPA=Valid)
    config = engine_config()
    assert get_mla_prefill_backend(config) is NeedsGPU
    with app_container.platform.override(providers.Object(cuda(8, 0))):
        assert get_mla_prefill_backend(config) is Valid
    assert get_mla_prefill_backend(config) is NeedsGPU


def test_cache_sees_a_member_registered_after_a_failed_lookup(
        app_container: Application) -> None:
    class ListsNewName(CpuPlatform):
        def mla_prefill_backend_priorities(self, selector_config: Any) -> list[str]:
            return ["LATE_MEMBER_FOR_CACHE_TEST", "TORCH_SDPA"]

    app_container.platform.override(providers.Object(ListsNewName()))
    with override_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, AlsoValid):
        config = engine_config()
        assert get_mla_prefill_backend(config) is AlsoValid
        register_mla_prefill_backend("LATE_MEMBER_FOR_CACHE_TEST", Valid)
        assert get_mla_prefill_backend(config) is Valid


def test_caches_are_per_container() -> None:
    a = create_container(platform=CpuPlatform())
    b = create_container(platform=CpuPlatform())
    config = engine_config()
    with use_container(a):
        register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, Valid)
        assert get_mla_prefill_backend(config) is Valid
    with use_container(b):
        register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, AlsoValid)
        assert get_mla_prefill_backend(config) is AlsoValid
    with use_container(a):
        assert get_mla_prefill_backend(config) is Valid
    assert get_mla_prefill_backend(config, container=b) is AlsoValid


def test_default_config_is_the_containers(app_container: Application) -> None:
    app_container.platform.override(providers.Object(CpuPlatform()))
    app_container.config.override(providers.Object(engine_config("CUSTOM")))
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Valid)
    assert get_mla_prefill_backend() is Valid


# --- the container provider ----------------------------------------------------------------


def test_container_provider_uses_its_own_container() -> None:
    a = create_container(engine_config("CUSTOM"), CpuPlatform())
    b = create_container(platform=CpuPlatform())
    with use_container(a):
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, Valid)
    with use_container(b):
        assert a.mla_prefill_backend_class() is Valid
        assert get_mla_prefill_backend(None, container=a) is Valid


# --- explain -------------------------------------------------------------------------------


def test_explain_covers_every_member(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASH_ATTN=HalfOnly, FLASHINFER=Valid, TORCH_SDPA=AlsoValid)
    explanation = explain_mla_prefill_selection(engine_config())
    assert list(explanation["backends"])[:len(BUILTINS) + 1] == [*BUILTINS, "CUSTOM"]
    assert set(MLAPrefillBackendEnum.__members__) <= set(explanation["backends"])
    backends = explanation["backends"]
    assert backends["FLASH_ATTN"]["valid"] is False
    assert backends["FLASH_ATTN"]["reasons"] == ["dtype torch.bfloat16 not supported"]
    assert backends["FLASH_ATTN"]["priority"] == 0
    assert backends["FLASHINFER"]["valid"] is True and backends["FLASHINFER"]["reasons"] == []
    assert backends["TRTLLM_RAGGED"]["priority"] is None
    assert backends["FLASHINFER"]["overridden"] is True
    assert backends["CUSTOM"]["class_path"] is None and backends["CUSTOM"]["valid"] is False
    assert explanation["priorities"] == ["FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]
    assert explanation["chosen"] == "FLASHINFER"
    assert explanation["chosen_class"] == f"{__name__}.Valid"
    assert explanation["error"] is None and explanation["requested"] is None
    assert explanation["device_capability"] == "9.0" and explanation["dtype"] == "bfloat16"
    json.dumps(explanation)  # JSON-friendly


def test_explain_agrees_with_the_errors(stubbed: Callable[..., None]) -> None:
    stubbed(cuda(9, 0), FLASHINFER=HalfOnly)
    for config in (engine_config("FLASHINFER"), engine_config()):
        explanation = explain_mla_prefill_selection(config)
        assert explanation["chosen"] is None
        with pytest.raises(ValueError) as info:
            get_mla_prefill_backend(config)
        assert explanation["error"] == str(info.value)
    explanation = explain_mla_prefill_selection(engine_config("FLASHINFER", dtype="float16"))
    assert explanation["chosen"] == "FLASHINFER" and explanation["requested"] == "FLASHINFER"


# --- the real built-in classes, where they exist -------------------------------------------


def test_cpu_default_is_the_builtin_torch_sdpa(app_container: Application) -> None:
    module = pytest.importorskip("app.backends.prefill.torch_sdpa")
    app_container.platform.override(providers.Object(CpuPlatform()))
    assert get_mla_prefill_backend(engine_config()) is module.TorchSDPABackend
