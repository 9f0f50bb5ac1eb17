"""Entry-point plugins, tested with a real installed distribution (tests/fixtures/plugin_dist)."""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import plugins
from app.containers import create_container
from app.platforms import CpuPlatform, CudaPlatform, detect_platform

#: installs the distribution into a scratch environment: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

PLUGIN_SRC = Path(__file__).parent / "fixtures" / "plugin_dist"


@pytest.fixture(scope="module")
def installed_plugin_dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Install the tiny plugin distribution with pip into a directory put on sys.path."""
    work = tmp_path_factory.mktemp("plugin_dist")
    src, target = work / "src", work / "site"
    shutil.copytree(PLUGIN_SRC, src)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        pytest.fail(f"pip could not install the plugin distribution:\n{proc.stderr}")
    sys.path.insert(0, str(target))
    plugins.reset_plugin_state()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m.startswith("app_test_plugins")]:
            del sys.modules[name]
        plugins.reset_plugin_state()


@pytest.fixture
def plugin_env(installed_plugin_dist: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    monkeypatch.delenv("APP_TEST_FAKE_NPU", raising=False)
    monkeypatch.delenv("APP_TEST_BROKEN_NPU", raising=False)
    plugins.reset_plugin_state()
    yield
    plugins.reset_plugin_state()


def test_the_distribution_is_really_installed(plugin_env: None) -> None:
    dist = importlib.metadata.distribution("app-test-plugins")
    groups = {ep.group for ep in dist.entry_points}
    assert groups == {plugins.PLATFORM_PLUGINS_GROUP, plugins.GENERAL_PLUGINS_GROUP}


def test_general_plugins_apply_to_new_containers_and_skip_failures(
        plugin_env: None, caplog: pytest.LogCaptureFixture) -> None:
    import app_test_plugins

    from app.backends import MLAPrefillBackendEnum

    before = app_test_plugins.CALLS["register_backend"]
    with caplog.at_level(logging.ERROR, logger="app.plugins"):
        container = create_container()
    assert container.applied_general_plugins() == {"register_backend": True, "exploding": False,
                                                   "half_done": False}
    assert "exploding" in caplog.text  # logged with its name, not fatal
    assert container.mla_prefill_backends.PLUGIN_SDPA() is app_test_plugins.PluginBackend
    assert MLAPrefillBackendEnum["PLUGIN_SDPA"].name == "PLUGIN_SDPA"
    # Idempotent per container; a second container gets its own registration.
    plugins.apply_general_plugins(container)
    assert app_test_plugins.CALLS["register_backend"] == before + 1
    other = create_container()
    assert app_test_plugins.CALLS["register_backend"] == before + 2
    assert other.mla_prefill_backends.PLUGIN_SDPA() is app_test_plugins.PluginBackend


def test_allow_list_filters_plugins(plugin_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.PLUGINS_ENV, "register_backend")
    plugins.reset_plugin_state()
    assert create_container().applied_general_plugins() == {"register_backend": True}
    monkeypatch.setenv(plugins.PLUGINS_ENV, "")
    plugins.reset_plugin_state()
    assert create_container().applied_general_plugins() == {}
    assert plugins.load_general_plugins() == []


def test_entry_points_are_imported_once(plugin_env: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = importlib.metadata.entry_points

    def counting(**kwargs: str) -> importlib.metadata.EntryPoints:
        calls.append(kwargs["group"])
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    plugins.load_general_plugins()
    plugins.load_general_plugins()
    create_container()  # (a plugin that registers a KV-cache spec detects the platform)
    create_container()
    assert calls.count(plugins.GENERAL_PLUGINS_GROUP) == 1
    assert calls.count(plugins.PLATFORM_PLUGINS_GROUP) <= 1


@pytest.mark.detected_platform
def test_platform_plugin_selected_only_when_present(plugin_env: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import app_test_plugins

    expected = CudaPlatform if _has_cuda() else CpuPlatform
    assert isinstance(detect_platform(), expected)
    monkeypatch.setenv("APP_TEST_FAKE_NPU", "1")
    platform = detect_platform()
    assert isinstance(platform, app_test_plugins.FakeNpuPlatform)
    monkeypatch.setenv(plugins.PLUGINS_ENV, "absent")
    plugins.reset_plugin_state()
    assert isinstance(detect_platform(), expected)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_general_plugins_register_decode_backends(plugin_env: None) -> None:
    import app_test_plugins.decode

    from app.config import EngineConfig

    config = EngineConfig.from_dict({"attention": {"mla_decode_backend": "PLUGIN_DECODE"}})
    container = create_container(config, CpuPlatform())
    assert container.mla_decode_backends.PLUGIN_DECODE() is \
        app_test_plugins.decode.PluginDecodeBackend
    assert container.mla_decode_backend_class() is app_test_plugins.decode.PluginDecodeBackend


def test_a_failed_general_plugin_leaves_nothing_registered(
        plugin_env: None, caplog: pytest.LogCaptureFixture) -> None:
    import app_test_plugins

    from app.backends import MLAPrefillBackendEnum, get_mla_prefill_backend
    from app.backends.catalog import PREFILL_BACKENDS
    from app.backends.prefill.torch_sdpa import TorchSDPABackend
    from app.containers import use_container
    from app.kvcache import FullAttentionSpec, KVCacheSpecRegistry

    with caplog.at_level(logging.ERROR, logger="app.plugins"):
        container = create_container(platform=CpuPlatform())
    assert container.applied_general_plugins()["half_done"] is False
    assert "general plugin half_done raised; what it registered was taken back" in caplog.text
    assert "PLUGIN_HALF_DONE" not in PREFILL_BACKENDS
    assert "PLUGIN_HALF_DONE" not in MLAPrefillBackendEnum.__members__
    assert "PLUGIN_HALF_DONE" not in container.mla_prefill_backends().providers
    with use_container(container):
        assert not MLAPrefillBackendEnum.TORCH_SDPA.is_overridden()
        assert get_mla_prefill_backend() is TorchSDPABackend
        registered = KVCacheSpecRegistry.registered_specs()
        assert app_test_plugins.HalfDoneSpec not in registered
        assert FullAttentionSpec in registered  # the built-ins it triggered stay
        # What the plugins that succeeded registered stays.
        assert MLAPrefillBackendEnum["PLUGIN_SDPA"].get_class() is app_test_plugins.PluginBackend


def test_app_platform_wins_over_a_platform_plugin(plugin_env: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_TEST_FAKE_NPU", "1")
    monkeypatch.setenv("APP_TEST_BROKEN_NPU", "1")  # not even built: the pin comes first
    monkeypatch.setenv("APP_PLATFORM", "cpu")
    assert isinstance(detect_platform(), CpuPlatform)
    monkeypatch.setenv("APP_PLATFORM", "cuda:10.0")
    assert str(detect_platform().get_device_capability()) == "10.0"


@pytest.mark.detected_platform
@pytest.mark.parametrize("detect", ["detect_platform", "create_container", "get_container"])
def test_a_platform_plugin_whose_platform_cannot_be_built_is_a_value_error(
        plugin_env: None, monkeypatch: pytest.MonkeyPatch, detect: str) -> None:
    from app.containers import get_container, use_container

    monkeypatch.setenv("APP_TEST_BROKEN_NPU", "1")
    calls = {"detect_platform": detect_platform,
             "create_container": lambda: create_container().platform(),
             "get_container": lambda: get_container().platform()}
    with use_container(create_container()), pytest.raises(ValueError) as info:
        calls[detect]()
    assert str(info.value) == ("platform plugin broken_npu returned "
                               "'app_test_plugins.BrokenNpuPlatform': constructing "
                               "BrokenNpuPlatform() raised RuntimeError: no NPU driver handle")
    assert isinstance(info.value.__cause__, RuntimeError)  # chained
