"""A tiny DeepSeek-V3 checkpoint written by hand (no transformers): ``config.json`` in the Hub's
layout and ``model.safetensors`` with the loader's canonical names (stacked experts, fused
gate/up), random weights. Fast enough to make one per test case; the base of the hostile
checkpoint tests (issue 33)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.model import DeepseekConfig, quantize_fp8_block, weight_specs

#: The tiny model: 2 layers (the first dense, the second MoE with 4 experts in 2 groups),
#: q LoRA, yarn rope, vocabulary 64.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
}

Tensors = dict[str, torch.Tensor]
#: A config value written as an integer literal of 5000 digits (Python's ``json`` cannot
#: write one: it refuses to convert more than 4300 digits).
HUGE_INT = "<an integer literal of 5000 digits>"


def tiny_tensors(config: dict[str, Any] | None = None, seed: int = 0) -> Tensors:
    """Random weights of ``config`` (default ``TINY_CONFIG``) by canonical name."""
    arch = DeepseekConfig.from_dict(config or TINY_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.ones(spec.shape) if len(spec.shape) == 1 and "bias" not in name
                   else 0.2 * torch.randn(spec.shape, generator=gen))
            for name, spec in weight_specs(arch).items()}


def write_tiny_checkpoint(path: Path, config: Callable[[dict[str, Any]], None] | None = None,
                          tensors: Callable[[Tensors], None] | None = None,
                          fp8_block: tuple[int, int] | None = None) -> Path:
    """Write the tiny checkpoint into ``path`` (created), ``config`` and ``tensors`` editing
    the config dict and the tensors first; ``fp8_block``: the 2-D projections FP8
    block-quantized with that block (and ``quantization_config`` saying so)."""
    from safetensors.torch import save_file

    raw = copy.deepcopy(TINY_CONFIG)
    weights = tiny_tensors()
    if fp8_block is not None:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": list(fp8_block)}
        for name in [n for n, t in weights.items() if t.dim() == 2 and "proj" in n]:
            weights[name], weights[f"{name}_scale_inv"] = quantize_fp8_block(weights[name],
                                                                            fp8_block)
    if config is not None:
        config(raw)
    if tensors is not None:
        tensors(weights)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw).replace(json.dumps(HUGE_INT),
                                                              "1" + "0" * 4999))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path
