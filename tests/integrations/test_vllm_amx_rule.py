"""On an AMX CPU, which MLA attention vLLM gets (``app.integrations._vllm_amx``): the rule on
plain names, reading ``AMX_MLA``'s dtypes from vLLM's source, and the config hook's effect,
with vLLM's objects stood in for (no vLLM needed; the whole engine with the CPU flag faked is
in ``test_vllm_engine.py``)."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.integrations import _vllm_amx
from app.integrations._vllm_amx import (
    amx_mla_dtypes,
    amx_routing_problems,
    decide_amx_backend,
    install_amx_routing,
    route_config,
)
from app.integrations._vllm_interface import _Sources

BF16 = ("bfloat16",)


@pytest.mark.parametrize(("args", "ours", "says"), [
    (("float32", "auto", None, BF16, "auto"), True, "cannot serve float32 (it declares "
                                                     "bfloat16 only)"),
    (("float16", "auto", None, BF16, "auto"), True, "cannot serve float16"),
    (("bfloat16", "fp8", None, BF16, "auto"), True, "cannot serve a fp8 KV cache"),
    (("bfloat16", "auto", None, BF16, "auto"), False, "has not been measured against it"),
    (("float32", "auto", "AMX_MLA", BF16, "auto"), False, "asked for attention backend "
                                                           "AMX_MLA"),
    (("float32", "auto", None, BF16, "vllm"), False, "APP_VLLM_AMX=vllm"),
    (("bfloat16", "auto", None, BF16, "ours"), True, "APP_VLLM_AMX=ours")])
def test_the_rule(args: tuple[Any, ...], ours: bool, says: str) -> None:
    decision = decide_amx_backend(*args, measured=None)
    assert decision.ours == ours and says in decision.reason


def test_bf16_follows_the_measurement_once_there_is_one() -> None:
    faster = decide_amx_backend("bfloat16", "auto", None, BF16, "auto", measured=1.8)
    assert faster.ours and "measured 1.80x vLLM's AMX_MLA decode" in faster.reason
    slower = decide_amx_backend("bfloat16", "auto", None, BF16, "auto", measured=0.9)
    assert not slower.ours and "measured faster than ours" in slower.reason
    assert _vllm_amx.MEASURED_DECODE_SPEEDUP is None   # no AMX machine has measured it yet


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_VLLM_AMX", "always")
    with pytest.raises(ValueError, match="APP_VLLM_AMX: expected one of auto, ours, vllm"):
        _vllm_amx.read_setting()


AMX_MLA_SOURCE = '''
class AMXMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
'''
CPU_PLATFORM_SOURCE = '''
class CpuPlatform(Platform):
    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        pass
'''
ATTENTION_SOURCE = '''
class AttentionConfig:
    backend: AttentionBackendEnum | None = None
    backend_per_kind: dict[str, AttentionBackendEnum] = field(default_factory=dict)
'''


def _vllm_tree(root: Path, amx: str = AMX_MLA_SOURCE) -> _Sources:
    for parts, text in ((("v1", "attention", "backends", "mla", "amx_mla.py"), amx),
                        (("platforms", "cpu.py"), CPU_PLATFORM_SOURCE),
                        (("config", "attention.py"), ATTENTION_SOURCE)):
        path = root.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return _Sources(root)


class FakeEnum:
    __members__ = {"AMX_MLA": "AMX_MLA", "CPU_MLA": "CPU_MLA"}
    CPU_MLA = SimpleNamespace(name="CPU_MLA")
    AMX_MLA = SimpleNamespace(name="AMX_MLA")


REGISTRY = SimpleNamespace(AttentionBackendEnum=FakeEnum)


def test_amx_mla_dtypes_and_the_interface_are_read_from_vllms_source(tmp_path: Path) -> None:
    sources = _vllm_tree(tmp_path)
    assert amx_mla_dtypes(sources) == BF16
    assert amx_routing_problems(sources, REGISTRY) == []
    two = AMX_MLA_SOURCE.replace("[torch.bfloat16]", "[torch.bfloat16, torch.float16]")
    assert amx_mla_dtypes(_vllm_tree(tmp_path / "two", two)) == ("bfloat16", "float16")
    odd = _vllm_tree(tmp_path / "odd", AMX_MLA_SOURCE.replace("[torch.bfloat16]", "DTYPES"))
    assert "not a list of torch dtypes" in str(amx_mla_dtypes(odd))
    assert amx_routing_problems(odd, SimpleNamespace()) == [
        "AttentionBackendEnum has no AMX_MLA or CPU_MLA",
        "AMXMLABackend.supported_dtypes is not a list of torch dtypes"]


def _config(dtype: torch.dtype, backend: Any = None, per_kind: dict[str, Any] | None = None,
            use_mla: bool = True, model_type: str = "deepseek_v2") -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla, dtype=dtype,
                                     hf_config=SimpleNamespace(model_type=model_type)),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        attention_config=SimpleNamespace(backend=backend, backend_per_kind=per_kind or {}))


def test_the_config_hook_gives_ours_what_amx_mla_refuses(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    monkeypatch.setattr(_vllm_amx, "_has_amx", lambda: True)
    caplog.set_level(logging.INFO, logger="vllm.plugins.app")
    fp32 = _config(torch.float32)
    assert route_config(fp32, BF16, FakeEnum).ours  # type: ignore[union-attr]
    assert fp32.attention_config.backend is FakeEnum.CPU_MLA
    assert "app: this CPU has AMX: vLLM's AMX_MLA cannot serve float32" in caplog.text
    bf16 = _config(torch.bfloat16)
    assert not route_config(bf16, BF16, FakeEnum).ours  # type: ignore[union-attr]
    assert bf16.attention_config.backend is None
    asked = _config(torch.float32, backend=FakeEnum.AMX_MLA)
    route_config(asked, BF16, FakeEnum)
    assert asked.attention_config.backend is FakeEnum.AMX_MLA
    per_kind = _config(torch.float32, per_kind={"mla_attention": FakeEnum.AMX_MLA})
    route_config(per_kind, BF16, FakeEnum)
    assert per_kind.attention_config.backend is None
    assert route_config(_config(torch.float32, use_mla=False), BF16, FakeEnum) is None
    assert route_config(_config(torch.float32, model_type="deepseek_v4"), BF16, FakeEnum) is None
    monkeypatch.setattr(_vllm_amx, "_has_amx", lambda: False)
    assert route_config(_config(torch.float32), BF16, FakeEnum) is None


def test_without_vllm_no_routing_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)
    assert "vllm" in str(install_amx_routing())
