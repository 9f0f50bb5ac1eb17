"""Loading checkpoints: both config layouts, shards, transformers 5's stacked experts, MTP
layers skipped, peak RSS measured, and every bad checkpoint refused (a ValueError naming the
tensor or key and the file) before anything is built."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.model import DeepseekConfig, load_checkpoint
from tests.model.hf_checkpoints import hf_model

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V3-like checkpoint, as transformers saves it."""
    path = tmp_path_factory.mktemp("plain")
    hf_model("v3").save_pretrained(path)
    return path


def _copy(plain: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
          config: Callable[[dict[str, Any]], None] | None = None) -> Path:
    tensors = safetensors_torch.load_file(str(plain / "model.safetensors"))
    raw = json.loads((plain / "config.json").read_text())
    if edit is not None:
        edit(tensors)
    if config is not None:
        config(raw)
    target.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(raw))
    return target


def test_the_hub_config_layout_reads_as_transformers_5s(plain: Path, tmp_path: Path) -> None:
    """DeepSeek's own config.json: rope_theta + rope_scaling {"type": "yarn", ...}, and
    torch_dtype instead of dtype."""
    raw = json.loads((plain / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("rope_interleave")
    hub = DeepseekConfig.from_dict(raw, "hub/config.json")
    assert hub == DeepseekConfig.from_json_file(plain / "config.json")
    assert hub.rope.rope_type == "yarn" and hub.rope.factor == 40.0 and hub.rope_interleave
    assert hub.moe is not None and hub.moe.scoring_func == "sigmoid" and hub.moe.n_group == 4


def test_transformers_5_stacked_experts_load_like_the_hub_layout(plain: Path,
                                                                 tmp_path: Path) -> None:
    def stack(t: dict[str, torch.Tensor]) -> None:
        for layer in (1, 2):
            p = f"model.layers.{layer}.mlp.experts"
            gate = [t.pop(f"{p}.{e}.gate_proj.weight") for e in range(16)]
            up = [t.pop(f"{p}.{e}.up_proj.weight") for e in range(16)]
            down = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(16)]
            t[f"{p}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up,
                                                                                strict=True)])
            t[f"{p}.down_proj"] = torch.stack(down)

    fused = load_checkpoint(_copy(plain, tmp_path / "fused", stack), torch.float32).weights
    hub = load_checkpoint(plain, torch.float32).weights
    assert all(torch.equal(a, b) for a, b in zip(fused.tensors(), hub.tensors(), strict=True))


def test_a_load_reports_its_peak_rss_and_skips_mtp_layers(plain: Path, tmp_path: Path) -> None:
    def mtp(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        t["model.layers.3.shared_head.head.weight"] = torch.zeros(256, 64)

    def one_mtp_layer(c: dict[str, Any]) -> None:
        c["num_nextn_predict_layers"] = 1

    loaded = load_checkpoint(_copy(plain, tmp_path / "mtp", mtp, one_mtp_layer),
                             torch.bfloat16)
    report = loaded.report
    assert report.skipped_mtp_tensors == 2 and report.skipped_mtp_layers == (3,)
    assert report.dtype == "bfloat16" and loaded.weights.dtype == torch.bfloat16
    assert report.model_bytes == loaded.weights.nbytes > 0
    assert report.peak_rss >= report.rss_before > 0
    assert loaded.eos_token_ids == (1,) and loaded.tokenizer_path is None
    described = report.describe()
    assert described["peak_rss_ratio"] == round(report.peak_rss_ratio, 4)


def _drop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[key]

    return drop


def _set(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(key, value)


def _cfg(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.update(changes)


@pytest.mark.parametrize(("tensors", "config", "message"), [
    (_drop("model.layers.1.mlp.experts.7.up_proj.weight"), None,
     r"'model.layers.1.mlp.experts.7.up_proj.weight' is missing: it is in none of "
     r"\['model.safetensors'\]"),
    (_drop("lm_head.weight"), None, r"'lm_head.weight' is missing: it is in none of"),
    (_set("model.layers.0.self_attn.extra.weight", torch.zeros(2)), None,
     r"model.safetensors: tensor 'model.layers.0.self_attn.extra.weight' is not part of"),
    (_set("model.layers.4.mlp.gate.weight", torch.zeros(2)), None,   # layer 3: MTP
     r"tensor 'model.layers.4.mlp.gate.weight' is not part of this DeepseekV3ForCausalLM "
     r"\(3 layers\)"),
    (_set("model.layers.0.self_attn.kv_b_proj.weight", torch.zeros(64, 16)), None,
     r"kv_b_proj.weight' has shape \[64, 16\], the config says \[128, 32\]"),
    (_set("model.norm.weight", torch.zeros(64, dtype=torch.int32)), None,
     r"'model.norm.weight' has dtype I32"),
    (_set("model.norm.weight", torch.zeros(64).to(torch.float8_e4m3fn)), None,
     r"is F8_E4M3 but config.json has no FP8 quantization_config"),
    (None, _cfg(architectures=["LlamaForCausalLM"]),
     r"config.json: architectures = \['LlamaForCausalLM'\]: unsupported"),
    (None, _cfg(quantization_config={"quant_method": "gptq"}),
     r"quantization_config: quant_method = 'gptq': unsupported"),
    (None, _cfg(hidden_size="64"), r"config.json: hidden_size = '64': expected an int >= 1"),
    (None, _cfg(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}),
     r"rope_type = 'longrope'"),
    (None, _cfg(n_group=3), r"n_group = 3: expected a divisor of n_routed_experts"),
    (None, _cfg(hidden_act="gelu"), r"hidden_act = 'gelu'"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor_and_the_file(
        plain: Path, tmp_path: Path, tensors: Any, config: Any, message: str) -> None:
    bad = _copy(plain, tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(bad)


def test_a_bad_directory_or_index_is_refused(plain: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_checkpoint(plain / "config.json")
    sharded = tmp_path / "sharded"
    hf_model("v3").save_pretrained(sharded, max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values())
                                     if f != index["weight_map"][name])
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: tensor 'model.norm.weight' is listed in"):
        load_checkpoint(sharded)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../x"}}')
    with pytest.raises(ValueError, match=r"shard '../x' is not a file"):
        load_checkpoint(sharded)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((plain / "config.json").read_text())
    with pytest.raises(ValueError, match=r"expected model\.safetensors"):
        load_checkpoint(tmp_path / "empty")
