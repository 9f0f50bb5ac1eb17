"""Config validation: every bad value gets a typed error naming the field and the value."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.config import AttentionConfig, CacheConfig, EngineConfig, ModelConfig, parse_dtype


def test_defaults_are_a_small_deepseek_layer() -> None:
    m = ModelConfig()
    assert (m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim) == (16, 512, 128, 64, 128)
    assert m.dtype is torch.bfloat16
    assert m.qk_head_dim == 192
    assert m.scale == pytest.approx(1 / math.sqrt(192))
    assert ModelConfig(softmax_scale=0.5).scale == 0.5


@pytest.mark.parametrize("name, expected", [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
    ("FP32", torch.float32), (torch.float16, torch.float16)])
def test_dtype_aliases(name: object, expected: torch.dtype) -> None:
    assert ModelConfig(dtype=name).dtype is expected


@pytest.mark.parametrize("field, value, exc, fragment", [
    ("dtype", "float8", ValueError, "'float8'"),
    ("dtype", torch.int8, ValueError, "torch.int8"),
    ("dtype", 3, TypeError, "3"),
    ("num_heads", 0, ValueError, "num_heads"),
    ("num_heads", -4, ValueError, "-4"),
    ("num_heads", "16", TypeError, "'16'"),
    ("num_heads", True, TypeError, "True"),
    ("kv_lora_rank", -1, ValueError, "kv_lora_rank"),
    ("qk_nope_head_dim", 0, ValueError, "qk_nope_head_dim"),
    ("qk_rope_head_dim", -1, ValueError, "qk_rope_head_dim"),
    ("v_head_dim", 0, ValueError, "v_head_dim"),
    ("hidden_size", 0, ValueError, "hidden_size"),
    ("softmax_scale", -1.0, ValueError, "softmax_scale"),
    ("softmax_scale", float("nan"), ValueError, "softmax_scale"),
    ("softmax_scale", "big", TypeError, "softmax_scale"),
])
def test_model_config_rejects(field: str, value: object, exc: type[Exception],
                              fragment: str) -> None:
    with pytest.raises(exc) as info:
        ModelConfig(**{field: value})  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert field in str(info.value) or "dtype" in str(info.value)


@pytest.mark.parametrize("field, value, exc", [
    ("block_size", 0, ValueError), ("block_size", -16, ValueError),
    ("block_size", 24, ValueError), ("num_blocks", 1, ValueError),
    ("num_blocks", -5, ValueError), ("enable_prefix_caching", "yes", TypeError),
    ("block_size", 16.0, TypeError)])
def test_cache_config_rejects(field: str, value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match=field):
        CacheConfig(**{field: value})  # type: ignore[arg-type]


def test_dtype_error_lists_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"allowed: .*bfloat16"):
        parse_dtype("double")


def test_attention_backend_by_name_member_or_none() -> None:
    from app.seed_api import MLAPrefillBackendEnum

    # The config stores validated names (strings), never enum members.
    assert AttentionConfig().mla_prefill_backend is None
    assert AttentionConfig(mla_prefill_backend="auto").mla_prefill_backend is None
    assert AttentionConfig(mla_prefill_backend="FLASHINFER").mla_prefill_backend == "FLASHINFER"
    member = MLAPrefillBackendEnum.TORCH_SDPA
    assert AttentionConfig(mla_prefill_backend=member).mla_prefill_backend == "TORCH_SDPA"
    assert AttentionConfig(mla_decode_backend="CPU_MLA").mla_decode_backend == "CPU_MLA"


def test_attention_unknown_backend_names_field_and_value() -> None:
    with pytest.raises(ValueError) as info:
        AttentionConfig(mla_prefill_backend="NOT A NAME")
    message = str(info.value)
    assert "mla_prefill_backend" in message and "NOT A NAME" in message
    # A well-formed but unknown name fails when the config is built (as vLLM's does), with
    # vLLM's message listing what is allowed.
    for build in (lambda: AttentionConfig(mla_prefill_backend="NONEXISTENT"),
                  lambda: EngineConfig.from_dict(
                      {"attention": {"mla_prefill_backend": "NONEXISTENT"}})):
        with pytest.raises(ValueError, match=r"Unknown MLA prefill backend: 'NONEXISTENT'\. "
                                             r"Valid options are: TORCH_SDPA, ") as info:
            build()
        assert "mla_prefill_backend" in str(info.value) and "CUSTOM" in str(info.value)
    with pytest.raises(ValueError, match=r"Unknown MLA decode backend: 'NONEXISTENT'\. "
                                         r"Valid options are: CPU_MLA, TORCH_SDPA, "):
        EngineConfig.from_dict({"attention": {"mla_decode_backend": "NONEXISTENT"}})
    with pytest.raises(TypeError, match="mla_prefill_backend"):
        AttentionConfig(mla_prefill_backend=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_chunk_tokens"):
        AttentionConfig(context_chunk_tokens=0)


def test_from_dict_round_trip() -> None:
    cfg = EngineConfig.from_dict({
        "model": {"dtype": "fp16", "num_heads": 8},
        "attention": {"mla_prefill_backend": "TORCH_SDPA"},
        "cache": {"block_size": 32, "num_blocks": 100, "enable_prefix_caching": False}})
    assert cfg.model.dtype is torch.float16 and cfg.model.num_heads == 8
    assert cfg.cache.block_size == 32 and not cfg.cache.enable_prefix_caching
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(EngineConfig.from_dict(cfg.to_dict()))


@pytest.mark.parametrize("data, exc, fragment", [
    ({"modle": {}}, ValueError, "modle"),
    ({"model": {"heads": 4}}, ValueError, "heads"),
    ({"model": []}, TypeError, "model"),
    ({"cache": {"block_size": -1}}, ValueError, "block_size"),
])
def test_from_dict_rejects(data: dict[str, object], exc: type[Exception], fragment: str) -> None:
    with pytest.raises(exc, match=fragment):
        EngineConfig.from_dict(data)


def test_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[model]\ndtype = "float32"\nnum_heads = 4\n\n[cache]\nblock_size = 8\n')
    cfg = EngineConfig.from_toml(path)
    assert cfg.model.dtype is torch.float32 and cfg.cache.block_size == 8
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        EngineConfig.from_toml(bad)
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig.from_toml(tmp_path / "missing.toml")


def test_configs_are_frozen() -> None:
    import attrs

    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ModelConfig().num_heads = 3  # type: ignore[misc]


def test_a_name_a_plugin_registered_beforehand_is_valid() -> None:
    """A name registered at run time (as a general plugin does) may be forced by a config built
    afterwards, for either kind; it is a process-wide name, like the enum member."""
    import uuid

    from app.backends import register_mla_decode_backend, register_mla_prefill_backend
    from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
    from app.backends.prefill.torch_sdpa import TorchSDPABackend
    from app.containers import create_container, use_container

    prefill, decode = (f"PLUGIN_{kind}_{uuid.uuid4().hex[:8].upper()}" for kind in "PD")
    for name, field in ((prefill, "mla_prefill_backend"), (decode, "mla_decode_backend")):
        with pytest.raises(ValueError, match=f"Unknown MLA .* backend: '{name}'"):
            AttentionConfig(**{field: name})
    with use_container(create_container()):
        register_mla_prefill_backend(prefill, TorchSDPABackend)
        register_mla_decode_backend(decode, TorchSDPADecodeBackend)
    config = EngineConfig.from_dict({"attention": {"mla_prefill_backend": prefill,
                                                   "mla_decode_backend": decode}})
    assert (config.attention.mla_prefill_backend, config.attention.mla_decode_backend) == (
        prefill, decode)
