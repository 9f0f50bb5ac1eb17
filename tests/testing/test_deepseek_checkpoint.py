"""Random DeepSeek checkpoints in the Hub's and transformers' config layouts (needs transformers:
it runs in the vLLM environment, where CI runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file
from transformers import AutoConfig

from app.testing.deepseek_checkpoint import (
    DeepseekCheckpointSpec,
    hub_config,
    transformers_greedy,
    write_deepseek_checkpoint,
)

SMALL = {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
         "num_heads": 2, "vocab_size": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": 32}


def test_the_hub_layout_is_the_hubs_and_transformers_reads_it(tmp_path: Path) -> None:
    for family in ("v2", "v3"):
        spec = DeepseekCheckpointSpec(family=family, **SMALL)
        path = write_deepseek_checkpoint(tmp_path / family, spec)
        config = json.loads((path / "config.json").read_text())
        assert config == hub_config(spec)
        assert "rope_parameters" not in config and config["rope_theta"] == 10000
        assert config["rope_scaling"]["type"] == "yarn"
        assert config["rope_scaling"]["mscale"] == (0.707 if family == "v2" else 1.0)
        assert (config["q_lora_rank"] is None) == (family == "v2")
        assert config["topk_method"] == ("greedy" if family == "v2" else "noaux_tc")
        read = AutoConfig.from_pretrained(path)
        assert read.model_type == f"deepseek_{family}"
        assert read.rope_parameters["rope_type"] == "yarn"
        assert read.rope_parameters["factor"] == 40


def test_the_transformers_layout_is_what_transformers_writes(tmp_path: Path) -> None:
    for rope in ("yarn", "default"):
        spec = DeepseekCheckpointSpec(layout="transformers", rope=rope, **SMALL)
        config = json.loads((write_deepseek_checkpoint(tmp_path / rope, spec)
                             / "config.json").read_text())
        assert "rope_scaling" not in config and "rope_theta" not in config
        assert config["rope_parameters"]["rope_type"] == rope
        assert config["head_dim"] == SMALL["qk_rope_head_dim"]


def test_same_spec_same_weights_in_either_layout_and_no_overwrite(tmp_path: Path) -> None:
    spec = DeepseekCheckpointSpec(num_layers=2, **SMALL)
    a = load_file(write_deepseek_checkpoint(tmp_path / "a", spec) / "model.safetensors")
    b = load_file(write_deepseek_checkpoint(
        tmp_path / "b", DeepseekCheckpointSpec(layout="transformers", num_layers=2, **SMALL))
        / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert {str(t.dtype) for t in a.values()} == {"torch.bfloat16"}
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in a      # MoE from layer 1 on
    assert "model.layers.0.mlp.gate_proj.weight" in a
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        write_deepseek_checkpoint(tmp_path / "a", spec)
    answers = transformers_greedy(tmp_path / "a", [[3, 4, 5], [9]], 4)
    assert [len(x["tokens"]) for x in answers] == [4, 4]
    assert [len(x["prompt_logprobs"]) for x in answers] == [2, 0]
    assert all(lp <= 0 for lp in answers[0]["prompt_logprobs"])


@pytest.mark.parametrize(("field", "value"), [("num_layers", 0), ("family", "v4"),
                                              ("layout", "gguf"), ("num_heads", True)])
def test_a_bad_spec_is_a_value_error(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field if field in ("num_layers", "num_heads") else
                       "must be in"):
        DeepseekCheckpointSpec(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["v32", "glm"])
def test_sparse_checkpoints_in_both_layouts_serve_transformers_tokens(tmp_path: Path,
                                                                      family: str) -> None:
    """V3.2 and GLM-MoE-DSA: the indexer's keys in both layouts (GLM-5's shared layer as
    ``index_topk_pattern`` in the Hub's, ``indexer_types`` in transformers'), the key norm
    drawn at random, and the engine's float32 tokens are transformers'."""
    import torch

    from tests.model.hf_checkpoints import engine_generate

    small = {**SMALL, "num_heads": 4, "qk_rope_head_dim": 16, "vocab_size": 128,
             "index_topk": 8, "index_head_dim": 32, "index_n_heads": 16}
    pattern = "FSF" if family == "glm" else None
    for layout in ("hub", "transformers"):
        spec = DeepseekCheckpointSpec(family=family, layout=layout, num_layers=3,
                                      indexer_pattern=pattern, **small)  # type: ignore[arg-type]
        path = write_deepseek_checkpoint(tmp_path / layout, spec)
        config = json.loads((path / "config.json").read_text())
        assert config["index_topk"] == 8 and config["index_n_heads"] == 16
        if family == "glm":
            key = "index_topk_pattern" if layout == "hub" else "indexer_types"
            assert config[key] in ("FSF", ["full", "shared", "full"])
        weights = load_file(path / "model.safetensors")
        norm = weights["model.layers.0.self_attn.indexer.k_norm.bias"]
        assert float(norm.float().abs().max()) > 0
        assert ("model.layers.1.self_attn.indexer.wk.weight" in weights) == (family == "v32")
    prompts = [[(5 * i) % 120 + 3 for i in range(40)], [7, 8, 9]]
    want = transformers_greedy(tmp_path / "hub", prompts, 4)
    got = engine_generate(tmp_path / "hub", prompts, 4, dtype=torch.float32)
    assert [list(o.output_token_ids) for o in got] == [x["tokens"] for x in want]
