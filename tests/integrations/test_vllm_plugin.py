"""The general plugin inside real vLLM (0.32's CPU build): vLLM's own plugin loader and selectors
pick our prefill and decode classes; ``VLLM_PLUGINS`` turns it off; a vLLM with another interface
gets nothing registered; its one line per process says what it replaced (kept until vLLM's
logging shows it); on an AMX CPU (faked) vLLM's own AMX_MLA stays, and CPU_MLA runs ours."""

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
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.v1.attention.backends import registry as attention_registry  # noqa: E402
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
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from app.integrations import (  # noqa: E402
    VLLM_BACKEND_CLASS_PATH,
    VLLM_DECODE_CLASS_PATH,
    VLLM_ENTRY_POINT,
    VLLM_VERIFIED_VERSION,
    _vllm_backends,
    _vllm_interface,
    _vllm_plugin,
    register_vllm_plugin,
    vllm_interface_problems,
)
from app.integrations.vllm import AppCPUMLAPrefillBackend  # noqa: E402
from app.integrations.vllm_decode import AppCPUMLABackend  # noqa: E402
from tests.integrations._vllm_inputs import backend_kwargs  # noqa: E402

VLLM_CPU_MLA = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
VLLM_AMX_MLA = "vllm.v1.attention.backends.mla.amx_mla.AMXMLABackend"
MLA_SELECTION = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16,
                                        kv_cache_dtype=None, block_size=None, use_mla=True)


@pytest.fixture
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The plugin's records (its logger is under vLLM's, which does not propagate to root)."""
    logger = logging.getLogger("vllm.plugins.app")
    logger.addHandler(caplog.handler)
    old, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False        # caplog also listens on the root logger: count once
    yield caplog
    logger.setLevel(old)
    logger.propagate = propagate
    logger.removeHandler(caplog.handler)


def _selected_decode(selected: AttentionBackendEnum | None = None) -> str:
    return CpuPlatform.get_attn_backend_cls(selected, MLA_SELECTION)


def _overridden() -> tuple[bool, bool]:
    return (MLAPrefillBackendEnum.CPU.is_overridden(),
            AttentionBackendEnum.CPU_MLA.is_overridden())


def test_verified_against_this_vllm() -> None:
    assert vllm.__version__ == VLLM_VERIFIED_VERSION == "0.32.0"
    assert vllm_interface_problems() == []


def test_vllm_selects_our_classes_after_its_own_load_general_plugins(fresh_vllm: None) -> None:
    assert get_mla_prefill_backend(None) is CPUSDPAMLAPrefillBackend
    assert _selected_decode() == VLLM_CPU_MLA
    _auto_select_mla_prefill_backend.cache_clear()
    vllm.plugins.load_general_plugins()
    assert MLAPrefillBackendEnum.CPU.get_path() == VLLM_BACKEND_CLASS_PATH
    assert get_mla_prefill_backend(None) is AppCPUMLAPrefillBackend
    assert _selected_decode() == VLLM_DECODE_CLASS_PATH
    assert AttentionBackendEnum.CPU_MLA.get_class() is AppCPUMLABackend


def test_the_entry_point_is_what_vllm_discovers(fresh_vllm: None) -> None:
    plugins = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    assert plugins[VLLM_ENTRY_POINT] is register_vllm_plugin


def test_vllm_plugins_allow_list_turns_it_off(fresh_vllm: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    vllm.plugins.load_general_plugins()
    assert _overridden() == (False, False)
    assert get_mla_prefill_backend(None) is CPUSDPAMLAPrefillBackend
    assert _selected_decode() == VLLM_CPU_MLA


def _extra_parameter(self: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     return_softmax_lse: bool, out: torch.Tensor | None = None,
                     output_scale: torch.Tensor | None = None, sinks: object = None
                     ) -> torch.Tensor:
    raise NotImplementedError


def _one_argument_register(backend: object) -> None:
    raise NotImplementedError


_FORWARD_MQA = (("v1", "attention", "backends", "mla", "cpu_mla.py"), "CPUMLAImpl",
                "forward_mqa")


@pytest.mark.parametrize(("patch", "reason"), [
    (lambda mp: mp.setattr(MLAPrefillBackend, "run_prefill_new_tokens", _extra_parameter),
     "MLAPrefillBackend.run_prefill_new_tokens"),
    (lambda mp: mp.setattr(registry, "register_mla_prefill_backend", _one_argument_register),
     "register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, class_path) does not bind"),
    (lambda mp: mp.setitem(_vllm_interface.METADATA_FIELDS, ("MLACommonPrefillMetadata",
                                                             "ContextChunk"),
                           frozenset({"index", "request_slice", "seq_lens_cpu"})),
     "MLACommonPrefillMetadata.ContextChunk has no field(s) ['seq_lens_cpu']"),
    (lambda mp: mp.setattr(MLAPrefillBackend, "__abstractmethods__",
                           frozenset({"get_name", "run_prefill_new_tokens",
                                      "run_prefill_context_chunk", "run_decode"})),
     "new abstract methods ['run_decode']"),
    (lambda mp: mp.setattr(attention_registry, "register_backend", _one_argument_register),
     "register_backend(AttentionBackendEnum.CPU_MLA, class_path) does not bind"),
    (lambda mp: mp.setitem(_vllm_interface.DECODE_METHODS, _FORWARD_MQA,
                           ("self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer",
                            "sinks")),
     "CPUMLAImpl.forward_mqa('self', 'q', 'kv_c_and_k_pe_cache', 'attn_metadata', 'layer') "
     "differs"),
    (lambda mp: mp.setitem(_vllm_interface.METADATA_FIELDS, ("MLACommonDecodeMetadata",),
                           frozenset({"block_table", "seq_lens", "query_lens"})),
     "MLACommonDecodeMetadata has no field(s) ['query_lens']"),
    (lambda mp: mp.setattr(_vllm_interface, "BUILDER_ATTRIBUTES",
                           frozenset({"num_heads", "mla_dims", "decode_plan"})),
     "MLACommonMetadataBuilder.__init__ no longer sets ['decode_plan']"),
], ids=["base-signature", "register-signature", "metadata-field", "abstract-method",
        "register-backend", "forward-mqa", "decode-field", "builder-attribute"])
def test_a_different_vllm_interface_registers_nothing_and_says_why(
        fresh_vllm: None, plugin_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, patch: object, reason: str) -> None:
    patch(monkeypatch)  # type: ignore[operator]
    register_vllm_plugin()
    assert _overridden() == (False, False)
    assert get_mla_prefill_backend(None) is CPUSDPAMLAPrefillBackend
    assert _selected_decode() == VLLM_CPU_MLA
    assert reason in plugin_log.text
    assert "not registering the CPU MLA prefill and decode" in plugin_log.text


def test_an_existing_override_is_left_alone(fresh_vllm: None,
                                            plugin_log: pytest.LogCaptureFixture) -> None:
    theirs = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa.CPUSDPAMLAPrefillBackend"
    registry.register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, theirs)
    register_vllm_plugin()
    assert MLAPrefillBackendEnum.CPU.get_path() == theirs
    assert _selected_decode() == VLLM_DECODE_CLASS_PATH      # the other one is still ours
    assert "CPU MLA prefill is already overridden by " + theirs in plugin_log.text
    MLAPrefillBackendEnum.CPU.clear_override()
    AttentionBackendEnum.CPU_MLA.clear_override()
    attention_registry.register_backend(AttentionBackendEnum.CPU_MLA, VLLM_CPU_MLA)
    register_vllm_plugin()
    assert _selected_decode() == VLLM_CPU_MLA
    assert get_mla_prefill_backend(None) is AppCPUMLAPrefillBackend
    assert f"CPU_MLA is already overridden by {VLLM_CPU_MLA}; left alone" in plugin_log.text


def test_without_our_decode_kernel_only_the_prefill_is_replaced(
        fresh_vllm: None, plugin_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_vllm_backends, "decode_unavailable_reason",
                        lambda: "native CPU decode kernel unavailable: no AVX-512F")
    register_vllm_plugin()
    assert _overridden() == (True, False)
    assert ("vLLM keeps its CPU_MLA decode: native CPU decode kernel unavailable: no "
            "AVX-512F") in plugin_log.text


def test_registering_twice_is_harmless_and_one_line_says_what_was_replaced(
        fresh_vllm: None, plugin_log: pytest.LogCaptureFixture) -> None:
    register_vllm_plugin()
    register_vllm_plugin()   # vLLM may load plugins in several processes, or again
    assert MLAPrefillBackendEnum.CPU.get_class() is AppCPUMLAPrefillBackend
    assert AttentionBackendEnum.CPU_MLA.get_class() is AppCPUMLABackend
    lines = [r.getMessage() for r in plugin_log.records]
    assert len(lines) == 2 and lines[0] == lines[1]
    assert ("running app.backends.prefill.torch_sdpa.TorchSDPAPrefillBackend (TORCH_SDPA"
            in lines[0])
    assert ("its CPU MLA decode (AttentionBackendEnum.CPU_MLA) is now "
            "app.integrations.vllm_decode.AppCPUMLABackend, running "
            "app.backends.decode.cpu_mla.CpuMLADecodeBackend (CPU_MLA") in lines[0]


def test_the_line_waits_for_vllms_logging_then_shows_once(
        fresh_vllm: None, plugin_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An in-process engine loads plugins before vLLM sets up its logging.
    monkeypatch.setattr(_vllm_plugin, "_can_show_info", lambda: False)
    register_vllm_plugin()
    assert _overridden() == (True, True)
    assert plugin_log.records == [] and len(_vllm_plugin._pending) == 1
    AppCPUMLAPrefillBackend(**backend_kwargs())          # too early still: kept
    assert plugin_log.records == []
    monkeypatch.setattr(_vllm_plugin, "_can_show_info", lambda: True)
    AppCPUMLAPrefillBackend(**backend_kwargs())          # vLLM builds its layers: shown
    AppCPUMLAPrefillBackend(**backend_kwargs())
    assert len(plugin_log.records) == 1
    assert "app: vLLM's CPU MLA prefill" in plugin_log.records[0].getMessage()


def test_on_an_amx_cpu_vllm_keeps_amx_mla_unless_cpu_mla_is_asked_for(
        fresh_vllm: None, plugin_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)   # faked
    monkeypatch.setattr(CpuPlatform, "get_cpu_architecture", classmethod(
        lambda cls: __import__("vllm.platforms.interface").platforms.interface.CpuArchEnum.X86))
    register_vllm_plugin()
    assert _overridden() == (True, True)
    assert not AttentionBackendEnum.AMX_MLA.is_overridden()
    assert _selected_decode() == VLLM_AMX_MLA                  # vLLM's own AMX kernels
    assert _selected_decode(AttentionBackendEnum.CPU_MLA) == VLLM_DECODE_CLASS_PATH
    assert ("this CPU has AMX: vLLM's AMX_MLA (its own AMX prefill and decode, which bypass "
            "both registrations) keeps bfloat16 models until ours is measured faster there; "
            "models it cannot serve (float32, float16) get CPU_MLA, which runs ours"
            ) in plugin_log.text
    # the routing is installed on vLLM's platform: a float32 MLA config gets CPU_MLA
    wrapped = CpuPlatform.__dict__["check_and_update_config"].__func__
    assert getattr(wrapped, "_app_amx_routing", False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert _vllm_plugin.amx_note() is None


def test_the_amx_routing_sets_cpu_mla_on_vllms_attention_config(
        fresh_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own AttentionConfig and enum through the rule (AMX faked): a float32 model's
    attention backend becomes CPU_MLA, a bfloat16 one's stays unset (vLLM picks AMX_MLA); the
    whole engine is in test_vllm_engine.py."""
    from types import SimpleNamespace

    from vllm.config import AttentionConfig

    from app.integrations import _vllm_amx

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)   # faked
    said: list[str] = []
    assert _vllm_amx.install_amx_routing(say=said.append) is None
    assert _vllm_amx.install_amx_routing(say=said.append) is None     # once
    settled = []
    for dtype in (torch.float32, torch.bfloat16):
        config = SimpleNamespace(
            model_config=SimpleNamespace(use_mla=True, dtype=dtype,
                                         hf_config=SimpleNamespace(model_type="deepseek_v2")),
            cache_config=SimpleNamespace(cache_dtype="auto"),
            attention_config=AttentionConfig())
        _vllm_amx.route_config(config, ("bfloat16",), AttentionBackendEnum, said.append)
        settled.append(config.attention_config.backend)
    assert settled == [AttentionBackendEnum.CPU_MLA, None]
    assert "cannot serve float32" in said[0] and "has not been measured" in said[1]


def test_our_methods_have_vllms_signatures() -> None:
    for name in _vllm_interface.BASE_METHODS:
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

    from vllm.model_executor.layers.attention import mla_attention

    source = Path(vllm.__file__).parent.joinpath(*_vllm_interface.METADATA_SOURCE)
    tree = ast.parse(source.read_text())
    for qualname in _vllm_interface.METADATA_FIELDS:
        cls = getattr(mla_attention, qualname[0])
        for part in qualname[1:]:
            cls = getattr(cls, part)
        assert _vllm_interface.class_fields(tree, qualname) == {
            f.name for f in dataclasses.fields(cls)}, qualname
