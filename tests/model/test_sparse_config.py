"""DeepSeek-V3.2 and GLM-MoE-DSA configs and checkpoints: what is read (the indexer, GLM-5's
shared layers, transformers' defaults), what is refused (with the file and the key), and the
checkpoint guarantees of issue 33 for the indexer's tensors (a missing, extra or misshapen one
fails at once naming the tensor and the file; FP8 ones dequantize)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from app.config import ModelConfig
from app.model import (
    DeepseekConfig,
    IndexerConfig,
    check_checkpoint,
    dequantize_fp8_block,
    load_checkpoint,
    quantize_fp8_block,
    random_config,
    weight_specs,
)
from tests.model.tiny_checkpoint import TINY_CONFIG, tiny_tensors

pytest.importorskip("safetensors")

V32: dict[str, Any] = {**copy.deepcopy(TINY_CONFIG), "architectures": ["DeepseekV32ForCausalLM"],
                       "model_type": "deepseek_v32", "index_topk": 8, "index_head_dim": 8,
                       "index_n_heads": 4}
GLM: dict[str, Any] = {**V32, "architectures": ["GlmMoeDsaForCausalLM"],
                       "model_type": "glm_moe_dsa", "num_hidden_layers": 3,
                       "indexer_types": ["full", "shared", "full"]}


def test_a_v32_config_reads_its_indexer_and_transformers_defaults() -> None:
    c = DeepseekConfig.from_dict(V32)
    assert c.indexer == IndexerConfig(index_topk=8, index_head_dim=8, index_n_heads=4,
                                      rope_interleave=False, layer_has_indexer=(True, True))
    model = c.model_config()
    assert (model.index_topk, model.index_head_dim, model.index_n_heads) == (8, 8, 4)
    assert model.is_sparse and c.describe()["indexer"]["shared_layers"] == []
    bare = {k: v for k, v in V32.items() if not k.startswith("index_")}
    defaults = DeepseekConfig.from_dict({**bare, "index_head_dim": 8}).indexer
    assert defaults is not None and (defaults.index_topk, defaults.index_n_heads) == (2048, 64)
    names = [n for n in weight_specs(c) if ".indexer." in n]
    assert sorted(names) == sorted(f"model.layers.{i}.self_attn.indexer.{t}" for i in range(2)
                                   for t in ("wq_b.weight", "wk.weight", "k_norm.weight",
                                             "k_norm.bias", "weights_proj.weight"))
    assert weight_specs(c)["model.layers.0.self_attn.indexer.weights_proj.weight"].float32


@pytest.mark.parametrize(("keys", "shared"), [
    ({"indexer_types": ["full", "shared", "full"]}, [1]),
    ({"index_topk_pattern": "FSS"}, [1, 2]),
    ({"index_topk_pattern": ["full", "full", "shared"]}, [2]),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, [1]),
    ({}, [])])
def test_glm_s_shared_layers_follow_transformers(keys: dict[str, Any], shared: list[int]
                                                 ) -> None:
    raw = {k: v for k, v in GLM.items() if k != "indexer_types"}
    c = DeepseekConfig.from_dict({**raw, **keys})
    assert c.indexer is not None and c.indexer.rope_interleave
    assert [i for i in range(3) if not c.indexer.has_indexer(i)] == shared
    specs = weight_specs(c)
    for i in range(3):
        assert (f"model.layers.{i}.self_attn.indexer.wk.weight" in specs) == (i not in shared)


def _transformers_pattern(freq: int, offset: int, layers: int) -> list[str]:
    transformers = pytest.importorskip("transformers")
    return list(transformers.GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq,
                                             index_skip_topk_offset=offset).indexer_types)


@pytest.mark.parametrize(("freq", "offset"), [(1, 2), (2, 1), (3, 2), (2, 0)])
def test_the_freq_schedule_is_transformers(freq: int, offset: int) -> None:
    want = _transformers_pattern(freq, offset, 7)
    raw = {k: v for k, v in GLM.items() if k != "indexer_types"}
    raw.update(num_hidden_layers=7, index_topk_freq=freq, index_skip_topk_offset=offset)
    if want[0] == "shared":      # transformers' own model raises at its first forward
        with pytest.raises(ValueError, match="index_skip_topk_offset = 0: expected an offset"):
            DeepseekConfig.from_dict(raw)
        return
    c = DeepseekConfig.from_dict(raw)
    assert c.indexer is not None
    assert ["full" if c.indexer.has_indexer(i) else "shared" for i in range(7)] == want


@pytest.mark.parametrize(("edit", "message"), [
    ({"rope_interleave": False}, "rope_interleave = False: expected true"),
    ({"q_lora_rank": None}, "q_lora_rank = None: expected an int: the indexer reads"),
    ({"index_head_dim": 2}, "index_head_dim = 2: expected an int >= qk_rope_head_dim (4)"),
    ({"index_topk": 0}, "index_topk = 0: expected an int >= 1"),
    ({"index_topk": 4097}, "index_topk = 4097: expected an int in [1, "
                           "max_position_embeddings = 4096]"),
    ({"index_topk": 2**31 - 1}, "index_topk = 2147483647: expected an int in [1, "
                                "max_position_embeddings = 4096]"),
    ({"index_n_heads": True}, "index_n_heads = True: expected an int >= 1"),
    ({"mlp_layer_types": ["sparse", "sparse"]}, "mlp_layer_types = ['sparse', 'sparse']: "
                                                "expected ['dense', 'sparse']")])
def test_a_bad_v32_config_names_the_key(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^config.json: {_escape(message)}"):
        DeepseekConfig.from_dict({**V32, **edit})


@pytest.mark.parametrize(("edit", "message"), [
    ({"indexer_types": ["shared", "full", "full"]}, "indexer_types = ['shared', 'full', "
                                                    "'full']: expected layer 0 'full'"),
    ({"indexer_types": ["full", "full"]}, "expected 3 entries"),
    ({"indexer_types": ["full", "sometimes", "full"]}, "each 'full' or 'shared'"),
    ({"indexer_types": None, "index_topk_pattern": "FX"}, "index_topk_pattern = 'FX'")])
def test_a_bad_glm_layer_pattern_names_the_key(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=_escape(message)):
        DeepseekConfig.from_dict({**GLM, **edit})


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_an_indexer_config_built_in_code_is_checked() -> None:
    with pytest.raises(ValueError, match="layer 0 must have an indexer"):
        IndexerConfig(index_topk=8, index_head_dim=8, index_n_heads=2,
                      layer_has_indexer=(False, True))
    with pytest.raises(ValueError, match="index_topk must be an int >= 1"):
        IndexerConfig(index_topk=0, index_head_dim=8, index_n_heads=2)
    sparse = random_config(ModelConfig(index_topk=16, index_head_dim=64, index_n_heads=4))
    assert sparse.architecture == "DeepseekV32ForCausalLM" and sparse.indexer is not None
    model = sparse.model_config()
    with pytest.raises(ValueError, match="index_topk: config 8, weights 16"):
        sparse.check_model_config(ModelConfig(**{**_fields(model), "index_topk": 8}))
    with pytest.raises(ValueError, match="index_topk: config None, weights 16"):
        sparse.check_model_config(ModelConfig(**{**_fields(model), "index_topk": None}))


def _fields(model: ModelConfig) -> dict[str, Any]:
    import attrs

    return attrs.asdict(model)


def _write(path: Path, raw: dict[str, Any], edit: Any = None,
           fp8: tuple[int, int] | None = None) -> Path:
    from safetensors.torch import save_file

    raw = copy.deepcopy(raw)
    weights = tiny_tensors(raw)
    if fp8 is not None:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": list(fp8)}
        for name in [n for n, t in weights.items() if t.dim() == 2 and (
                ".indexer.w" in n or "proj" in n)]:
            weights[name], weights[f"{name}_scale_inv"] = quantize_fp8_block(weights[name],
                                                                            fp8)
    if edit is not None:
        edit(weights)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def test_a_sparse_checkpoint_loads_and_fp8_indexer_weights_dequantize(tmp_path: Path) -> None:
    plain = load_checkpoint(_write(tmp_path / "plain", GLM), torch.float32)
    indexer = plain.weights.layers[0].attention.indexer
    assert indexer is not None and plain.weights.layers[1].attention.indexer is None
    fp8_dir = _write(tmp_path / "fp8", GLM, fp8=(4, 8))
    fp8 = load_checkpoint(fp8_dir, torch.float32)
    from safetensors.torch import load_file

    raw = load_file(str(fp8_dir / "model.safetensors"))
    key = "model.layers.2.self_attn.indexer.wq_b.weight"
    want = dequantize_fp8_block(raw[key], raw[f"{key}_scale_inv"], (4, 8),
                                torch.empty(raw[key].shape))
    got = fp8.weights.layers[2].attention.indexer
    assert got is not None and torch.equal(got.wq_b, want)
    assert fp8.report.fp8_tensors > 0


def _drop(name: str) -> Any:
    return lambda w: w.pop(name)


@pytest.mark.parametrize(("edit", "message"), [
    (_drop("model.layers.2.self_attn.indexer.k_norm.bias"),
     "tensor 'model.layers.2.self_attn.indexer.k_norm.bias' is missing: it is in none of "
     "['model.safetensors']"),
    (lambda w: w.update({"model.layers.1.self_attn.indexer.wk.weight": torch.zeros(8, 32)}),
     "model.safetensors: tensor 'model.layers.1.self_attn.indexer.wk.weight' is not part of "
     "this GlmMoeDsaForCausalLM"),
    (lambda w: w.update({"model.layers.0.self_attn.indexer.wq_b.weight": torch.zeros(31, 16)}),
     "model.safetensors: tensor 'model.layers.0.self_attn.indexer.wq_b.weight' has shape "
     "[31, 16], the config says [32, 16]"),
    (lambda w: w.update({"model.layers.0.self_attn.indexer.k_norm.bias":
                         torch.zeros(8, dtype=torch.int8)}),
     "model.safetensors: tensor 'model.layers.0.self_attn.indexer.k_norm.bias' has dtype "
     "I8")])
def test_a_hostile_sparse_checkpoint_fails_at_once_naming_file_and_key(
        tmp_path: Path, edit: Any, message: str) -> None:
    directory = _write(tmp_path / "bad", GLM, edit)
    for call in (check_checkpoint, load_checkpoint):
        with pytest.raises(ValueError, match=_escape(message)):
            call(directory)
