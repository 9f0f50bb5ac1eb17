"""The general plugin inside real vLLM 0.33: vLLM's own plugin loader and selector pick our
class; ``VLLM_PLUGINS`` turns it off; a vLLM with another interface gets nothing registered."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import pytest
import torch

from tests.integrations._require import require_vllm

require_vllm()

import vllm  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import (  # noqa: E402
    MLAPrefillBackendEnum,
    get_mla_prefill_backend,
    registry,
)
from vllm.v1.attention.backends.mla.prefill.base import (  # noqa: E402
    MLADimensions,
    MLAPrefillBackend,
)
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (  # noqa: E402
    CPUSDPAMLAPrefillBackend,
)
from vllm.v1.attention.backends.mla.prefill.selector import (  # noqa: E402
    MLAPrefillSelectorConfig,
    _auto_select_mla_prefill_backend,
)

from app.integrations import (  # noqa: E402
    VLLM_BACKEND_CLASS_PATH,
    VLLM_ENTRY_POINT,
    VLLM_VERIFIED_VERSION,
    _vllm_plugin,
    register_vllm_plugin,
    vllm_interface_problems,
)
from app.integrations.vllm import AppCPUMLAPrefillBackend  # noqa: E402


@pytest.fixture
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The plugin's records (its logger is under vLLM's, which does not propagate to root)."""
    logger = logging.getLogger("vllm.plugins.app")
    logger.addHandler(caplog.handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.setLevel(old)
    logger.removeHandler(caplog.handler)


def test_verified_against_this_vllm() -> None:
    assert vllm.__version__ == VLLM_VERIFIED_VERSION
    assert vllm_interface_problems() == []


def test_vllm_selects_our_backend_after_its_own_load_general_plugins(fresh_vllm: None) -> None:
    assert get_mla_prefill_backend(None) is CPUSDPAMLAPrefillBackend
    _auto_select_mla_prefill_backend.cache_clear()
    vllm.plugins.load_general_plugins()
    assert MLAPrefillBackendEnum.CPU.get_path() == VLLM_BACKEND_CLASS_PATH
    assert get_mla_prefill_backend(None) is AppCPUMLAPrefillBackend


def test_the_entry_point_is_what_vllm_discovers(fresh_vllm: None) -> None:
    plugins = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    assert plugins[VLLM_ENTRY_POINT] is register_vllm_plugin


def test_vllm_plugins_allow_list_turns_it_off(fresh_vllm: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    vllm.plugins.load_general_plugins()
    assert not MLAPrefillBackendEnum.CPU.is_overridden()
    assert get_mla_prefill_backend(None) is CPUSDPAMLAPrefillBackend


def _extra_parameter(self: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     return_softmax_lse: bool, out: torch.Tensor | None = None,
                     output_scale: torch.Tensor | None = None, sinks: object = None
                     ) -> torch.Tensor:
    raise NotImplementedError


def _one_argument_register(backend: object) -> None:
    raise NotImplementedError


@pytest.mark.parametrize(("patch", "reason"), [
    (lambda mp: mp.setattr(MLAPrefillBackend, "run_prefill_new_tokens", _extra_parameter),
     "MLAPrefillBackend.run_prefill_new_tokens"),
    (lambda mp: mp.setattr(registry, "register_mla_prefill_backend", _one_argument_register),
     "register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, class_path) does not bind"),
    (lambda mp: mp.setitem(_vllm_plugin.METADATA_FIELDS, ("MLACommonPrefillMetadata",
                                                          "ContextChunk"),
                           frozenset({"index", "request_slice", "seq_lens_cpu"})),
     "MLACommonPrefillMetadata.ContextChunk has no field(s) ['seq_lens_cpu']"),
    (lambda mp: mp.setattr(MLAPrefillBackend, "__abstractmethods__",
                           frozenset({"get_name", "run_prefill_new_tokens",
                                      "run_prefill_context_chunk", "run_decode"})),
     "new abstract methods ['run_decode']"),
], ids=["base-signature", "register-signature", "metadata-field", "abstract-method"])
def test_a_different_vllm_interface_registers_nothing_and_says_why(
        fresh_vllm: None, plugin_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, patch: object, reason: str) -> None:
    patch(monkeypatch)  # type: ignore[operator]
    register_vllm_plugin()
    assert not MLAPrefillBackendEnum.CPU.is_overridden()
    assert get_mla_prefill_backend(None) is CPUSDPAMLAPrefillBackend
    assert reason in plugin_log.text
    assert "not registering" in plugin_log.text


def test_an_existing_override_of_cpu_is_left_alone(fresh_vllm: None,
                                                   plugin_log: pytest.LogCaptureFixture) -> None:
    theirs = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa.CPUSDPAMLAPrefillBackend"
    registry.register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, theirs)
    register_vllm_plugin()
    assert MLAPrefillBackendEnum.CPU.get_path() == theirs
    assert "already overridden" in plugin_log.text


def test_registering_twice_is_harmless(fresh_vllm: None,
                                       plugin_log: pytest.LogCaptureFixture) -> None:
    register_vllm_plugin()
    register_vllm_plugin()   # vLLM may load plugins in several processes, or again
    assert MLAPrefillBackendEnum.CPU.get_class() is AppCPUMLAPrefillBackend
    assert "running app.backends.prefill.torch_sdpa.TorchSDPABackend (TORCH_SDPA" in plugin_log.text


def test_our_methods_have_vllms_signatures() -> None:
    for name in _vllm_plugin.BASE_METHODS:
        ours = getattr(AppCPUMLAPrefillBackend, name)
        base = getattr(MLAPrefillBackend, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(base).parameters), name
    assert not inspect.isabstract(AppCPUMLAPrefillBackend)


def test_validate_configuration_says_why_not_on_a_gpu() -> None:
    from vllm.platforms.interface import DeviceCapability

    dims = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        config = MLAPrefillSelectorConfig(dtype=dtype, mla_dimensions=dims)
        assert AppCPUMLAPrefillBackend.validate_configuration(None, config) == []
    bad = MLAPrefillSelectorConfig(dtype=torch.int8, mla_dimensions=dims)
    assert AppCPUMLAPrefillBackend.validate_configuration(None, bad) == [
        "dtype torch.int8 not supported"]
    assert AppCPUMLAPrefillBackend.validate_configuration(
        DeviceCapability(9, 0), MLAPrefillSelectorConfig(dtype=torch.bfloat16,
                                                         mla_dimensions=dims)) == [
        "compute capability 9.0 not supported"]
    assert AppCPUMLAPrefillBackend.is_available()


def test_metadata_fields_read_from_source_are_the_dataclasses_fields() -> None:
    import ast
    import dataclasses
    from pathlib import Path

    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    source = Path(vllm.__file__).parent.joinpath(*_vllm_plugin.METADATA_SOURCE)
    tree = ast.parse(source.read_text())
    for qualname in _vllm_plugin.METADATA_FIELDS:
        cls = MLACommonPrefillMetadata
        for part in qualname[1:]:
            cls = getattr(cls, part)
        assert _vllm_plugin._class_fields(tree, qualname) == {
            f.name for f in dataclasses.fields(cls)}, qualname
