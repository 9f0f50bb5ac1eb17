"""Tiny random DeepSeek checkpoints made with Hugging Face transformers (the reference), and
the engine's greedy generation on them.

- ``V2_LITE``: DeepSeek-V2-Lite's shape scaled down: no q LoRA, MoE (softmax gate, greedy)
  with two shared experts, the first layer dense, yarn rope with mscale 0.707;
- ``V2_GROUPED``: V2 with q LoRA and ``group_limited_greedy`` routing;
- ``V3``: q LoRA, MoE with groups (sigmoid gate, a non-zero ``e_score_correction_bias``),
  ``norm_topk_prob`` and ``routed_scaling_factor``, yarn rope with mscale 1;
- ``V3_ROTATE_HALF``: a V3 whose config says ``rope_interleave: false``;
- ``PRODUCTION``: V3 at production attention dims (H=16, kv_lora_rank 512, rope 64, nope 128,
  v 128), small hidden size and vocabulary.

Weights are transformers' own init (``initializer_range`` 0.1) with the LM head scaled up so
the top-2 logits are far apart (measured: ``tests/model/test_transformers_parity.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.config import EngineConfig
from app.containers import create_container
from app.mla import MLAEngine, Request, RequestOutput
from app.model import load_checkpoint, quantize_fp8_block

YARN_V2 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
           "original_max_position_embeddings": 4096, "mscale": 0.707,
           "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
YARN_V3 = {**YARN_V2, "mscale": 1.0, "mscale_all_dim": 1.0}
_SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
          "max_position_embeddings": 163840, "initializer_range": 0.1}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2_lite": ("v2", {**_SMALL, "q_lora_rank": None, "n_routed_experts": 8,
                       "n_shared_experts": 2, "num_experts_per_tok": 2, "topk_method": "greedy",
                       "rope_parameters": YARN_V2}),
    "v2_grouped": ("v2", {**_SMALL, "q_lora_rank": 24, "n_routed_experts": 8,
                          "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4,
                          "topk_group": 2, "topk_method": "group_limited_greedy",
                          "routed_scaling_factor": 1.5, "rope_parameters": YARN_V2}),
    "v3": ("v3", {**_SMALL, "q_lora_rank": 48, "n_routed_experts": 16, "n_shared_experts": 1,
                  "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                  "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                  "rope_parameters": YARN_V3}),
    "v3_rotate_half": ("v3", {**_SMALL, "q_lora_rank": 48, "n_routed_experts": 8,
                              "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
                              "topk_group": 1, "rope_interleave": False,
                              "rope_parameters": YARN_V3}),
    "production": ("v3", {**_SMALL, "hidden_size": 256, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "kv_lora_rank": 512,
                          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                          "q_lora_rank": 96, "num_hidden_layers": 2, "intermediate_size": 256,
                          "moe_intermediate_size": 64, "n_routed_experts": 8,
                          "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
                          "topk_group": 1, "rope_parameters": YARN_V3}),
}
#: The LM head's gain over transformers' init (wide top-2 gaps).
LM_HEAD_GAIN = 6.0


def hf_model(name: str, seed: int = 0) -> Any:
    """A transformers model of ``MODELS[name]`` (float32, eval mode)."""
    import transformers

    family, kwargs = MODELS[name]
    torch.manual_seed(seed)
    if family == "v2":
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kwargs))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.1)
    return model.eval()


def prompts(vocab: int, lengths: Sequence[int] = (5, 17, 40, 9), seed: int = 1
            ) -> list[list[int]]:
    """Random prompts (token 0 and 1, bos and eos, left out)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy ``generate``: ``new`` tokens, no eos stop."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def hf_logprobs(model: Any, tokens: list[int]) -> torch.Tensor:
    """float64 log-softmax of every position of ``tokens`` under ``model``: ``[S, vocab]``."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def engine_generate(directory: Path, all_prompts: list[list[int]], new: int,
                    dtype: torch.dtype = torch.float32, step_tokens: int = 16,
                    kv_cache_dtype: str = "auto") -> list[RequestOutput]:
    """The engine's greedy generation from a checkpoint directory (every prompt at once, a
    small step budget so prefill is chunked and decode batches mix; ``kv_cache_dtype`` the
    latent cache's)."""
    loaded = load_checkpoint(directory, dtype)
    config = EngineConfig.from_dict({"cache": {"block_size": 4, "num_blocks": 1024,
                                               "kv_cache_dtype": kv_cache_dtype}})
    config = EngineConfig(model=loaded.config.model_config(dtype), cache=config.cache)
    engine = MLAEngine(create_container(config), weights=loaded.weights,
                       step_tokens=step_tokens)
    outputs = {o.request_id: o for o in engine.run(
        Request(f"p{i}", p, max_new_tokens=new) for i, p in enumerate(all_prompts))}
    return [outputs[f"p{i}"] for i in range(len(all_prompts))]


def write_fp8_copy(source: Path, target: Path, block: tuple[int, int] = (32, 32),
                   mtp_layers: int = 1) -> None:
    """An FP8 copy of float32 checkpoint ``source`` as DeepSeek-V3 ships them: every 2-D
    projection (not the embedding, the LM head or the router) in float8_e4m3fn with its
    ``weight_scale_inv``, ``quantization_config`` in ``config.json``; plus ``mtp_layers``
    multi-token-prediction layers (random tensors under ``model.layers.{N}``) to be skipped."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        plain = value.dim() != 2 or key in ("model.embed_tokens.weight", "lm_head.weight") \
            or key.endswith("mlp.gate.weight")
        if plain:
            out[key] = value
            continue
        fp8, scale = quantize_fp8_block(value, block)
        out[key] = fp8
        out[key.removesuffix("weight") + "weight_scale_inv"] = scale
    n = config["num_hidden_layers"]
    for j in range(mtp_layers):
        prefix = f"model.layers.{n + j}"
        out[f"{prefix}.enorm.weight"] = torch.ones(config["hidden_size"])
        fp8, scale = quantize_fp8_block(torch.randn(config["hidden_size"],
                                                    2 * config["hidden_size"]), block)
        out[f"{prefix}.eh_proj.weight"] = fp8
        out[f"{prefix}.eh_proj.weight_scale_inv"] = scale
        out[f"{prefix}.self_attn.kv_a_layernorm.weight"] = torch.ones(config["kv_lora_rank"])
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": list(block)}
    config["num_nextn_predict_layers"] = mtp_layers
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
