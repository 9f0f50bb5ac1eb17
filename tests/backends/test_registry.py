"""The MLA prefill backend registry: the enum facade over the active container's providers."""

from __future__ import annotations

import pickle
import threading
import uuid
from typing import Any

import pytest
from dependency_injector import providers

from app.backends import (
    MLAPrefillBackend,
    MLAPrefillBackendEnum,
    explain_mla_prefill_selection,
    get_mla_prefill_backend,
    override_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.catalog import PREFILL_BACKENDS
from app.config import AttentionConfig, EngineConfig
from app.containers import (
    Application,
    create_container,
    get_container,
    use_container,
)
from app.platforms import CpuPlatform
from app.testing import SelectionOnlyBackend

BUILTINS = ["TORCH_SDPA", "FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TOKENSPEED_MLA",
            "TORCH_SPARSE", "CPU_MLA_SPARSE"]


class StubBackend(SelectionOnlyBackend):
    """Valid everywhere; never runs."""

    @staticmethod
    def get_name() -> str:
        return "STUB"



class OtherBackend(StubBackend):
    pass


class ThirdBackend(StubBackend):
    pass


class NotABackend:
    pass


STUB_PATH = f"{__name__}.StubBackend"
OTHER_PATH = f"{__name__}.OtherBackend"


def unique(prefix: str) -> str:
    """A member name no other test uses (run-time members are process-global)."""
    return f"{prefix}_{uuid.uuid4().hex[:10].upper()}"


# --- the enum ------------------------------------------------------------------------------


def test_members_and_values() -> None:
    names = list(MLAPrefillBackendEnum.__members__)
    assert names[:len(BUILTINS) + 1] == [*BUILTINS, "CUSTOM"]
    for name in BUILTINS:
        assert MLAPrefillBackendEnum[name].value == PREFILL_BACKENDS.builtins[name]
    assert MLAPrefillBackendEnum.CUSTOM.value is None


def test_custom_is_not_an_alias() -> None:
    custom = MLAPrefillBackendEnum.CUSTOM
    assert all(custom is not MLAPrefillBackendEnum[n] for n in BUILTINS)
    assert MLAPrefillBackendEnum(None) is custom
    assert MLAPrefillBackendEnum["CUSTOM"] is custom
    assert len({m.value for m in MLAPrefillBackendEnum if m.name in BUILTINS}) == len(BUILTINS)


def test_unknown_name_is_a_value_error_listing_the_options() -> None:
    with pytest.raises(ValueError) as info:
        MLAPrefillBackendEnum["NOPE"]
    message = str(info.value)
    assert message.startswith("Unknown MLA prefill backend: 'NOPE'. Valid options are: "
                              "TORCH_SDPA, FLASH_ATTN, FLASHINFER, TRTLLM_RAGGED, "
                              "TOKENSPEED_MLA, TORCH_SPARSE, CPU_MLA_SPARSE, CUSTOM")


def test_members_pickle_by_name(app_container: Application) -> None:
    name = unique("PICKLED")
    register_mla_prefill_backend(name, StubBackend)
    for member in (MLAPrefillBackendEnum.FLASHINFER, MLAPrefillBackendEnum.CUSTOM,
                   MLAPrefillBackendEnum[name]):
        assert pickle.loads(pickle.dumps(member)) is member


def test_config_stores_names_and_selection_resolves_them(app_container: Application) -> None:
    assert AttentionConfig(mla_prefill_backend="flashinfer").mla_prefill_backend == "flashinfer"
    assert AttentionConfig(mla_prefill_backend="auto").mla_prefill_backend is None
    config = EngineConfig.from_dict({"attention": {"mla_prefill_backend": "torch_sdpa"}})
    assert get_mla_prefill_backend(config).get_name() == "TORCH_SDPA"  # upper case matches
    with pytest.raises(ValueError, match="Unknown MLA prefill backend: 'nope'"):
        get_mla_prefill_backend(EngineConfig.from_dict(
            {"attention": {"mla_prefill_backend": "nope"}}))


# --- get_path / get_class / is_overridden / clear_override ---------------------------------


def test_defaults(app_container: Application) -> None:
    for name in BUILTINS:
        member = MLAPrefillBackendEnum[name]
        assert member.get_path() == PREFILL_BACKENDS.builtins[name]
        assert not member.is_overridden()
        assert member.is_registered()
    assert not MLAPrefillBackendEnum.CUSTOM.is_registered()


def test_unregistered_custom_says_how_to_register(app_container: Application) -> None:
    for call in (MLAPrefillBackendEnum.CUSTOM.get_path, MLAPrefillBackendEnum.CUSTOM.get_class):
        with pytest.raises(ValueError) as info:
            call()
        assert "must be registered before use" in str(info.value)
        assert "register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, " in str(info.value)


def test_register_by_path_overrides_at_once(app_container: Application) -> None:
    decorator = register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, STUB_PATH)
    assert decorator(OtherBackend) is OtherBackend  # a no-op decorator
    custom = MLAPrefillBackendEnum.CUSTOM
    assert custom.is_overridden() and custom.is_registered()
    assert custom.get_path() == STUB_PATH
    assert custom.get_class() is StubBackend
    assert app_container.mla_prefill_backends.CUSTOM() is StubBackend


def test_register_a_bad_path_fails_on_use_not_on_registration(
        app_container: Application) -> None:
    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER, "no.such.module.Backend")
    assert MLAPrefillBackendEnum.FLASHINFER.get_path() == "no.such.module.Backend"
    with pytest.raises(ImportError, match=r"no\.such\.module"):
        MLAPrefillBackendEnum.FLASHINFER.get_class()
    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER, f"{__name__}.NotABackend")
    with pytest.raises(TypeError, match="not an MLAPrefillBackend subclass"):
        MLAPrefillBackendEnum.FLASHINFER.get_class()


@pytest.mark.parametrize("bad", ["", "NoDots", ".Class", "pkg."])
def test_register_a_malformed_path_is_a_value_error(app_container: Application,
                                                    bad: str) -> None:
    with pytest.raises(ValueError, match="dotted class path"):
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, bad)
    assert not MLAPrefillBackendEnum.CUSTOM.is_overridden()


def test_register_rejects_wrong_types(app_container: Application) -> None:
    with pytest.raises(TypeError):
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, 7)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, NotABackend)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        register_mla_prefill_backend(3)  # type: ignore[arg-type]


def test_decorator_records_the_class_itself(app_container: Application) -> None:
    @register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN)
    class LocalBackend(StubBackend):  # defined in a function: not importable by path
        pass

    assert MLAPrefillBackendEnum.FLASH_ATTN.get_class() is LocalBackend
    assert MLAPrefillBackendEnum.FLASH_ATTN.get_path().endswith("LocalBackend")
    assert MLAPrefillBackendEnum.FLASH_ATTN.is_overridden()


def test_decorator_refuses_a_non_backend_right_away(app_container: Application) -> None:
    decorator = register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM)
    with pytest.raises(TypeError, match="not an MLAPrefillBackend subclass"):
        decorator(NotABackend)
    assert not MLAPrefillBackendEnum.CUSTOM.is_overridden()


def test_clear_override(app_container: Application) -> None:
    register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, STUB_PATH)
    register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, OTHER_PATH)
    assert MLAPrefillBackendEnum.TORCH_SDPA.get_class() is OtherBackend
    MLAPrefillBackendEnum.TORCH_SDPA.clear_override()
    assert not MLAPrefillBackendEnum.TORCH_SDPA.is_overridden()
    assert MLAPrefillBackendEnum.TORCH_SDPA.get_path() == PREFILL_BACKENDS.builtins[
        "TORCH_SDPA"]
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, StubBackend)
    MLAPrefillBackendEnum.CUSTOM.clear_override()
    with pytest.raises(ValueError, match="must be registered before use"):
        MLAPrefillBackendEnum.CUSTOM.get_class()
    MLAPrefillBackendEnum.CUSTOM.clear_override()  # clearing twice is harmless


def test_direct_provider_overrides_are_seen(app_container: Application) -> None:
    app_container.mla_prefill_backends.FLASHINFER.override(providers.Object(StubBackend))
    assert MLAPrefillBackendEnum.FLASHINFER.is_overridden()
    assert MLAPrefillBackendEnum.FLASHINFER.get_class() is StubBackend
    assert MLAPrefillBackendEnum.FLASHINFER.get_path() == STUB_PATH


# --- new members at run time ---------------------------------------------------------------


def test_new_name_by_path(app_container: Application) -> None:
    name = unique("NEW_PATH")
    assert register_mla_prefill_backend(name, STUB_PATH)(OtherBackend) is OtherBackend
    member = MLAPrefillBackendEnum[name]
    assert member.name == name and member.value is None
    assert getattr(MLAPrefillBackendEnum, name) is member
    assert member in list(MLAPrefillBackendEnum)
    assert member.get_class() is StubBackend and member.get_path() == STUB_PATH
    assert MLAPrefillBackendEnum(None) is MLAPrefillBackendEnum.CUSTOM  # still no alias
    config = AttentionConfig(mla_prefill_backend=name)
    assert config.mla_prefill_backend == member.name


def test_new_name_as_decorator(app_container: Application) -> None:
    name = unique("NEW_DECO")

    @register_mla_prefill_backend(name)
    class Decorated(StubBackend):
        pass

    assert MLAPrefillBackendEnum[name].get_class() is Decorated


def test_new_name_decorator_refuses_a_non_backend_and_adds_nothing(
        app_container: Application) -> None:
    name = unique("NEVER_ADDED")
    decorator = register_mla_prefill_backend(name)
    with pytest.raises(TypeError):
        decorator(NotABackend)
    assert name not in MLAPrefillBackendEnum.__members__


def test_duplicate_names_are_refused(app_container: Application) -> None:
    name = unique("DUP")
    register_mla_prefill_backend(name, STUB_PATH)
    with pytest.raises(ValueError, match="already exists"):
        register_mla_prefill_backend(name, OTHER_PATH)
    with pytest.raises(ValueError, match="already exists"):
        register_mla_prefill_backend(name)
    for builtin in [*BUILTINS, "CUSTOM"]:
        with pytest.raises(ValueError, match="already exists"):
            register_mla_prefill_backend(builtin, STUB_PATH)
    assert MLAPrefillBackendEnum[name].get_class() is StubBackend
    assert list(MLAPrefillBackendEnum.__members__).count(name) == 1


@pytest.mark.parametrize("bad", ["bad name", "1ABC", "", "MY-BACKEND", "_PRIVATE", "class",
                                 "get_path", "name", "providers", "override"])
def test_invalid_or_reserved_names_are_refused(app_container: Application, bad: str) -> None:
    before = list(MLAPrefillBackendEnum.__members__)
    with pytest.raises(ValueError):
        register_mla_prefill_backend(bad, STUB_PATH)
    assert list(MLAPrefillBackendEnum.__members__) == before


def test_new_member_exists_everywhere_but_is_registered_only_in_its_container() -> None:
    name = unique("ONLY_IN_A")
    a, b = create_container(), create_container()
    with use_container(a):
        register_mla_prefill_backend(name, StubBackend)
    member = MLAPrefillBackendEnum[name]
    with use_container(b):
        assert not member.is_registered() and not member.is_overridden()
        with pytest.raises(ValueError, match="must be registered before use"):
            member.get_class()
        with pytest.raises(ValueError, match="must be registered before use"):
            member.get_path()
        member.clear_override()  # nothing to clear
        # The other container may register it too, by member or by name.
        register_mla_prefill_backend(name, OtherBackend)
        assert member.get_class() is OtherBackend
    with use_container(a):
        assert member.get_class() is StubBackend
    c = create_container()
    with use_container(c):
        register_mla_prefill_backend(member, ThirdBackend)
        assert member.get_class() is ThirdBackend


# --- containers ----------------------------------------------------------------------------


def test_override_in_one_container_is_invisible_in_another() -> None:
    a, b = create_container(), create_container()
    with use_container(a):
        register_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER, StubBackend)
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, OtherBackend)
        assert MLAPrefillBackendEnum.FLASHINFER.get_class() is StubBackend
        with use_container(b):
            assert not MLAPrefillBackendEnum.FLASHINFER.is_overridden()
            assert not MLAPrefillBackendEnum.CUSTOM.is_registered()
        assert MLAPrefillBackendEnum.CUSTOM.get_class() is OtherBackend
    assert not b.mla_prefill_backends.FLASHINFER.overridden
    assert not get_container().mla_prefill_backends.FLASHINFER.overridden


def test_registrations_live_in_the_container_providers() -> None:
    a, b = create_container(), create_container()
    with use_container(a):
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, StubBackend)
    assert a.mla_prefill_backends.CUSTOM() is StubBackend
    assert b.mla_prefill_backends.CUSTOM() is None
    assert not hasattr(a, "registry_state") and not hasattr(a, "registry_lock")
    # nothing stashed on the container instance: only its providers
    assert not [name for name in vars(a) if name.startswith("_app_")]


# --- the scoped override -------------------------------------------------------------------


def test_scoped_override_restores_the_default(app_container: Application) -> None:
    with override_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER, StubBackend) as member:
        assert member is MLAPrefillBackendEnum.FLASHINFER
        assert member.get_class() is StubBackend and member.is_overridden()
    assert not MLAPrefillBackendEnum.FLASHINFER.is_overridden()
    assert MLAPrefillBackendEnum.FLASHINFER.get_path() == PREFILL_BACKENDS.builtins[
        "FLASHINFER"]


def test_scoped_override_restores_on_exception(app_container: Application) -> None:
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, StubBackend)
    with pytest.raises(RuntimeError, match="boom"), \
            override_mla_prefill_backend("CUSTOM", OTHER_PATH):
        assert MLAPrefillBackendEnum.CUSTOM.get_class() is OtherBackend
        raise RuntimeError("boom")
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is StubBackend
    assert MLAPrefillBackendEnum.CUSTOM.is_overridden()


def test_scoped_overrides_nest_and_keep_registrations_made_inside(
        app_container: Application) -> None:
    member = MLAPrefillBackendEnum.TORCH_SDPA
    with override_mla_prefill_backend(member, StubBackend):
        with override_mla_prefill_backend(member, OtherBackend):
            assert member.get_class() is OtherBackend
        assert member.get_class() is StubBackend
    assert not member.is_overridden()
    with override_mla_prefill_backend(member, StubBackend):
        register_mla_prefill_backend(member, ThirdBackend)  # permanent: survives the block
        assert member.get_class() is ThirdBackend
    assert member.get_class() is ThirdBackend
    member.clear_override()
    assert not member.is_overridden()
    with override_mla_prefill_backend(member, StubBackend):
        member.clear_override()
        assert not member.is_overridden()
    assert not member.is_overridden()


def test_scoped_override_of_a_member_registered_elsewhere() -> None:
    name = unique("SCOPED_ELSEWHERE")
    with use_container(create_container()):
        register_mla_prefill_backend(name, StubBackend)
    member = MLAPrefillBackendEnum[name]
    other = create_container()
    with use_container(other):
        with override_mla_prefill_backend(member, OtherBackend):
            assert member.get_class() is OtherBackend
        assert not member.is_registered()
        assert other.mla_prefill_backends().providers.get(name) is None


def test_scoped_override_restores_the_container_it_was_entered_in() -> None:
    a, b = create_container(), create_container()
    with use_container(a):
        scope = override_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN, StubBackend)
        scope.__enter__()
    with use_container(b):
        scope.__exit__(None, None, None)
    assert not a.mla_prefill_backends.FLASH_ATTN.overridden


def test_scoped_override_checks_its_arguments(app_container: Application) -> None:
    with pytest.raises(ValueError, match="Unknown MLA prefill backend"), \
            override_mla_prefill_backend("NOPE", StubBackend):
        pass
    with pytest.raises(TypeError), \
            override_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, NotABackend):  # type: ignore[arg-type]
        pass
    assert not MLAPrefillBackendEnum.CUSTOM.is_overridden()


# --- threads -------------------------------------------------------------------------------


def test_eight_threads_registering_and_selecting_end_consistent() -> None:
    container = create_container(EngineConfig(), CpuPlatform())
    config = EngineConfig()
    race_name = unique("RACE")
    prefix = unique("T")
    classes = [type(f"ThreadBackend{i}", (StubBackend,), {}) for i in range(8)]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    race_wins: list[int] = []
    seen: set[type[Any]] = set()

    def work(i: int) -> None:
        try:
            with use_container(container):
                barrier.wait()
                try:
                    register_mla_prefill_backend(race_name, classes[i])
                    race_wins.append(i)
                except ValueError:
                    pass
                for k in range(25):
                    register_mla_prefill_backend(f"{prefix}_{i}_{k}", classes[i])
                    register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, classes[i])
                    with override_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, classes[i]):
                        seen.add(get_mla_prefill_backend(config))
                    seen.add(get_mla_prefill_backend(config))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(race_wins) == 1
    names = list(MLAPrefillBackendEnum.__members__)
    assert len(names) == len(set(names))
    with use_container(container):
        assert MLAPrefillBackendEnum[race_name].get_class() is classes[race_wins[0]]
        for i in range(8):
            for k in range(25):
                assert MLAPrefillBackendEnum[f"{prefix}_{i}_{k}"].get_class() is classes[i]
        # Every scoped override was undone; TORCH_SDPA keeps one of the permanent ones.
        assert not MLAPrefillBackendEnum.CUSTOM.is_overridden()
        assert len(container.mla_prefill_backends.TORCH_SDPA.overridden) == 8 * 25
        final = MLAPrefillBackendEnum.TORCH_SDPA.get_class()
        assert final in classes
        assert get_mla_prefill_backend(config) is final
    assert seen <= set(classes)


# --- abstract classes are refused (issue 12 item 7) ----------------------------------------


class HalfBackend(MLAPrefillBackend):
    """Abstract: implements nothing of the run interface."""

    @staticmethod
    def get_name() -> str:
        return "HALF"


def test_abstract_classes_are_refused_at_registration(app_container: Application) -> None:
    from app.backends import MLADecodeBackend, register_mla_decode_backend

    for target in (MLAPrefillBackend, HalfBackend):
        with pytest.raises(TypeError, match="abstract"):
            register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, target)
        with pytest.raises(TypeError, match="abstract"):
            register_mla_prefill_backend(unique("ABS"), target)
        with pytest.raises(TypeError, match="abstract"):
            register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM)(target)
        with pytest.raises(TypeError, match="abstract"), \
                override_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, target):
            pass
    with pytest.raises(TypeError, match="abstract"):
        register_mla_decode_backend("ABS_DECODE", MLADecodeBackend)
    assert not MLAPrefillBackendEnum.CUSTOM.is_registered()
    # A path is imported on first use: the abstract class is refused there, with the reason.
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM,
                                 "app.backends.prefill.base.MLAPrefillBackend")
    with pytest.raises(TypeError, match="abstract"):
        MLAPrefillBackendEnum.CUSTOM.get_class()
    explanation = explain_mla_prefill_selection()
    assert not explanation["backends"]["CUSTOM"]["valid"]
    assert "abstract" in explanation["backends"]["CUSTOM"]["reasons"][0]


def test_deployment_refuses_an_abstract_backend(tmp_path: Any) -> None:
    from app import deployment

    path = tmp_path / "d.toml"
    path.write_text('[backends]\nMYABS = "app.backends.prefill.base.MLAPrefillBackend"\n')
    with pytest.raises(TypeError, match="abstract"):
        deployment.load(path)
