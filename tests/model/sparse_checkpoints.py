"""Tiny random DeepSeek-V3.2 and GLM-MoE-DSA checkpoints made with transformers (the reference).

Both are V3-like (q LoRA, MoE with groups, a non-zero score bias, yarn rope) with DeepSeek Sparse
Attention: ``index_topk`` 8 (prompts of 40-120 tokens are genuinely sparse), 16 index heads of
16 (with few heads a key often scores exactly 0 on every head, a tie the top-k breaks
arbitrarily), the key LayerNorm drawn around its identity. ``glm`` shares layer 1's selection
(``index_topk_pattern`` ``"FSF"``). ``as_dense_v3`` makes transformers' dense V3 with the same
weights (the indexer left out).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.model.hf_checkpoints import LM_HEAD_GAIN, YARN_V3

SPARSE_SMALL: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "first_k_dense_replace": 1, "max_position_embeddings": 163840, "initializer_range": 0.1,
    "q_lora_rank": 48, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rope_parameters": YARN_V3, "index_topk": 8,
    "index_head_dim": 16, "index_n_heads": 16}
SPARSE_MODELS: dict[str, dict[str, Any]] = {
    "v32": {},
    "glm": {"index_topk_pattern": "FSF"},
}
#: Prompt lengths: one shorter than index_topk (dense for all its rows), the others sparse.
LENGTHS = (40, 77, 5, 120)


def hf_sparse_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model of ``SPARSE_MODELS[name]`` (float32, eval mode)."""
    import transformers

    kwargs = {**SPARSE_SMALL, **SPARSE_MODELS[name], **overrides}
    torch.manual_seed(seed)
    if name == "v32":
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**kwargs))
    else:
        model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**kwargs))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
        for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "e_score_correction_bias" in key:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
            elif ".indexer.k_norm." in key:
                noise = torch.randn(tensor.shape, generator=gen) * 0.2
                tensor.copy_(1.0 + noise if key.endswith("weight") else noise)
    return model.eval()


def as_dense_v3(model: Any) -> Any:
    """transformers' dense DeepSeek-V3 with ``model``'s weights (no indexer)."""
    import transformers

    kwargs = {k: v for k, v in SPARSE_SMALL.items() if not k.startswith("index_")}
    dense = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    state = {k: v for k, v in model.state_dict().items() if ".indexer." not in k}
    missing, unexpected = dense.load_state_dict(state, strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise AssertionError(f"weights do not map onto V3: {missing} {unexpected}")
    return dense.eval()


def with_index_topk(source: Path, target: Path, index_topk: int) -> Path:
    """A copy of checkpoint ``source`` whose ``config.json`` says ``index_topk``."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["index_topk"] = index_topk
    (target / "config.json").write_text(json.dumps(config))
    return target
