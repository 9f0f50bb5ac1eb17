"""Random DeepSeek models made in memory: the main job's model, and tests' models.

``random_config(model, num_layers, vocab_size)`` is a DeepSeek-V3-shaped architecture around a
``ModelConfig``'s attention dims: q LoRA, yarn rope (factor 4 over 4096 original positions,
mscale 1, mscale_all_dim 0.8: cos/sin and the softmax scale both corrected), interleaved rope,
and MoE (16 routed experts in 4 groups, 2 groups and 4 experts per token, a sigmoid gate with a
score-correction bias, normalised and scaled weights, one shared expert); layer 0 is dense when
there is more than one layer (``first_k_dense_replace``). A ``ModelConfig`` with
``index_topk`` gives DeepSeek-V3.2's sparse variant (``DeepseekV32ForCausalLM``: an indexer
of ``index_n_heads`` x ``index_head_dim`` in every layer, roped in halves).

``random_weights(config, dtype, seed)`` draws every tensor in float32 from ``seed`` and rounds
it once to ``dtype``: deterministic, the same values on every machine. Scales keep activations
near unit size and make attention sharper than uniform and the LM head's top-2 logits far
apart, as trained models are.
"""

from __future__ import annotations

import math

import torch

from app._validation import MAX_GENERATOR_SEED, check_int_at_least, check_seed
from app.config import ModelConfig
from app.model.config import DeepseekConfig, MoEConfig, RopeConfig
from app.model.sparse.config import IndexerConfig
from app.model.weights import ModelWeights, weight_specs

__all__ = ["random_config", "random_weights"]

#: Gains over a unit-variance ``1/sqrt(fan_in)`` init, by the tensor's last name part.
_GAINS = {"q_proj.weight": 2.0, "q_b_proj.weight": 2.0, "lm_head.weight": 3.0,
          "gate.weight": 2.0}


def random_config(model: ModelConfig, num_layers: int = 1, vocab_size: int = 4096,
                  *, moe: bool = True) -> DeepseekConfig:
    """A V3-shaped architecture (see the module docstring) at ``model``'s attention dims
    (``model.softmax_scale`` must be unset: the yarn rope sets the scale)."""
    check_int_at_least("num_layers", num_layers, 1)
    check_int_at_least("vocab_size", vocab_size, 2)
    if model.softmax_scale is not None:
        raise ValueError("random_config: ModelConfig.softmax_scale must be None (the model's "
                         "rope sets it); use DeepseekConfig.model_config() for the engine")
    d = model.hidden_size
    experts = MoEConfig(n_routed_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=max(d // 4, 8), n_shared_experts=1,
                        scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5)
    rope = RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0,
                      original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.8)
    indexer = None if model.index_topk is None else IndexerConfig(
        index_topk=model.index_topk, index_head_dim=model.index_head_dim,
        index_n_heads=model.index_n_heads, layer_has_indexer=(True,) * num_layers)
    return DeepseekConfig(
        architecture="DeepseekV3ForCausalLM" if indexer is None else "DeepseekV32ForCausalLM",
        vocab_size=vocab_size, hidden_size=d, indexer=indexer,
        intermediate_size=2 * d, num_hidden_layers=num_layers,
        num_attention_heads=model.num_heads, q_lora_rank=max(3 * d // 8, 8),
        kv_lora_rank=model.kv_lora_rank, qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim,
        max_position_embeddings=16384, rope=rope, rope_interleave=True,
        moe=experts if moe else None, first_k_dense_replace=min(1, num_layers - 1),
        dtype=model.dtype)


def random_weights(config: DeepseekConfig, dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0) -> ModelWeights:
    """Every tensor of ``config``'s model drawn from ``seed`` (float32, rounded to ``dtype``;
    the router float32): norms ``1 + 0.1 N(0, 1)``, the embedding ``N(0, 1)``, projections
    ``N(0, gain^2 / fan_in)``, V3's score bias ``N(0, 0.05^2)``."""
    check_seed("random_weights: seed", seed, MAX_GENERATOR_SEED)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in weight_specs(config).items():
        target = torch.float32 if spec.float32 else dtype
        values = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = values.mul_(0.1).add_(1.0)
        elif name.endswith("e_score_correction_bias"):
            values.mul_(0.05)
        elif name != "model.embed_tokens.weight":
            gain = next((g for suffix, g in _GAINS.items() if name.endswith(suffix)), 1.0)
            values.mul_(gain / math.sqrt(spec.shape[-1]))
        tensors[name] = values.to(target)
    return ModelWeights.from_tensors(config, tensors)
