"""Random DeepSeek checkpoints (V2, V3, and the sparse V3.2 and GLM-MoE-DSA) at production
attention dims, for engine tests and benches.

:func:`write_deepseek_checkpoint` writes a Hugging Face checkpoint (``config.json`` plus
``model.safetensors``) of random weights made by transformers' own ``DeepseekV2ForCausalLM`` /
``DeepseekV3ForCausalLM`` / ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM``, in one of two
config layouts:

- ``"hub"``: the layout of the Hub's ``deepseek-ai/DeepSeek-V2-Lite`` and ``DeepSeek-V3``
  ``config.json`` (``rope_theta`` and ``rope_scaling`` at the top level, ``"type": "yarn"``,
  the MoE routing keys ``topk_method`` / ``scoring_func`` / ``n_group`` ...). transformers reads
  it (converting ``rope_scaling`` to its ``rope_parameters``) to build the model, and the file
  stays as the Hub writes it.
- ``"transformers"``: what transformers (5.x) writes itself: a ``rope_parameters`` dict
  (``rope_type``, ``rope_theta``, the yarn keys), ``head_dim``, ``qk_head_dim``.

The sparse families (``"v32"``, ``"glm"``: DeepSeek Sparse Attention) add the indexer's keys
(``index_topk``, ``index_head_dim``, ``index_n_heads``; GLM-5's ``shared`` layers from
``indexer_pattern``, e.g. ``"FSFS"``, written as ``index_topk_pattern`` in the Hub layout and as
transformers' ``indexer_types`` in its own); the key LayerNorm's weight and bias are drawn at
random (transformers starts them at 1 and 0, which would hide either).

Sizes other than attention are small (hidden 256, a few experts of 128) so that an engine starts
in seconds; the MLA attention dims are DeepSeek's (``kv_lora_rank`` 512, rope 64, nope 128, v
128) unless the spec says otherwise. ``initializer_range`` 0.1 (transformers' 0.02 makes a
random model's greedy output one repeated token, useless for comparing engines).

Needs ``transformers`` and ``safetensors`` (imported when called; both come with vLLM).
"""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import attrs

__all__ = ["DeepseekCheckpointSpec", "hub_config", "transformers_greedy",
           "write_deepseek_checkpoint"]

Layout = Literal["hub", "transformers"]
Family = Literal["v2", "v3", "v32", "glm"]
#: The sparse families' architectures and model types.
_SPARSE = {"v32": ("DeepseekV32ForCausalLM", "deepseek_v32"),
           "glm": ("GlmMoeDsaForCausalLM", "glm_moe_dsa")}


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeepseekCheckpointSpec.{attribute.name} must be an int >= 1, got "
                         f"{value!r}")


@attrs.frozen
class DeepseekCheckpointSpec:
    """What to write. ``family`` ``"v2"`` is DeepSeek-V2-Lite-like (no q LoRA, softmax greedy
    routing), ``"v3"`` DeepSeek-V3-like (q LoRA, sigmoid ``noaux_tc`` routing with groups),
    ``"v32"`` / ``"glm"`` V3-like with DeepSeek Sparse Attention (V3.2's indexer ropes halves,
    GLM-5's adjacent pairs and may share a layer's selection: ``indexer_pattern``);
    ``rope`` ``"yarn"`` (the Hub's scaling) or ``"default"`` (none); ``moe``: every layer from
    the second on is a MoE layer (else all dense)."""

    family: Family = attrs.field(default="v2",
                                 validator=attrs.validators.in_(("v2", "v3", "v32", "glm")))
    layout: Layout = attrs.field(default="hub",
                                 validator=attrs.validators.in_(("hub", "transformers")))
    rope: Literal["yarn", "default"] = attrs.field(
        default="yarn", validator=attrs.validators.in_(("yarn", "default")))
    num_layers: int = attrs.field(default=2, validator=_positive)
    num_heads: int = attrs.field(default=16, validator=_positive)
    hidden_size: int = attrs.field(default=256, validator=_positive)
    intermediate_size: int = attrs.field(default=512, validator=_positive)
    vocab_size: int = attrs.field(default=1024, validator=_positive)
    kv_lora_rank: int = attrs.field(default=512, validator=_positive)
    qk_rope_head_dim: int = attrs.field(default=64, validator=_positive)
    qk_nope_head_dim: int = attrs.field(default=128, validator=_positive)
    v_head_dim: int = attrs.field(default=128, validator=_positive)
    q_lora_rank: int = attrs.field(default=256, validator=_positive)
    moe: bool = True
    num_experts: int = attrs.field(default=4, validator=_positive)
    moe_intermediate_size: int = attrs.field(default=128, validator=_positive)
    initializer_range: float = 0.1
    seed: int = 0
    index_topk: int = attrs.field(default=16, validator=_positive)
    index_head_dim: int = attrs.field(default=64, validator=_positive)
    index_n_heads: int = attrs.field(default=8, validator=_positive)
    #: GLM-5 only: one letter per layer, ``F`` (own indexer) or ``S`` (shared); None: all F.
    indexer_pattern: str | None = None


def _rope_scaling(spec: DeepseekCheckpointSpec) -> dict[str, Any] | None:
    if spec.rope == "default":
        return None
    mscale = 0.707 if spec.family == "v2" else 1.0    # V2-Lite's and V3's values
    return {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": mscale,
            "mscale_all_dim": mscale, "original_max_position_embeddings": 4096, "type": "yarn"}


def hub_config(spec: DeepseekCheckpointSpec) -> dict[str, Any]:
    """The ``config.json`` of ``spec`` in the Hub's layout (keys as in DeepSeek-V2-Lite's /
    DeepSeek-V3's own files, sizes from ``spec``)."""
    v3 = spec.family != "v2"
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
        "first_k_dense_replace": 1 if spec.moe else spec.num_layers,
        "hidden_act": "silu", "hidden_size": spec.hidden_size,
        "initializer_range": spec.initializer_range,
        "intermediate_size": spec.intermediate_size, "kv_lora_rank": spec.kv_lora_rank,
        "max_position_embeddings": 163840 if spec.rope == "yarn" else 4096,
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "moe_intermediate_size": spec.moe_intermediate_size, "moe_layer_freq": 1,
        "n_group": 2 if v3 else 1, "n_routed_experts": spec.num_experts,
        "n_shared_experts": 1, "norm_topk_prob": v3, "num_attention_heads": spec.num_heads,
        "num_experts_per_tok": 2, "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_heads, "pretraining_tp": 1,
        "q_lora_rank": spec.q_lora_rank if v3 else None,
        "qk_nope_head_dim": spec.qk_nope_head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "rms_norm_eps": 1e-06, "rope_scaling": _rope_scaling(spec), "rope_theta": 10000,
        "routed_scaling_factor": 2.5 if v3 else 1.0,
        "scoring_func": "sigmoid" if v3 else "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc" if v3 else "greedy", "torch_dtype": "bfloat16",
        "use_cache": True, "v_head_dim": spec.v_head_dim, "vocab_size": spec.vocab_size,
    }
    if v3:
        config["num_nextn_predict_layers"] = 0
    if spec.family in _SPARSE:
        config["architectures"], config["model_type"] = [_SPARSE[spec.family][0]], \
            _SPARSE[spec.family][1]
        config.update(index_topk=spec.index_topk, index_head_dim=spec.index_head_dim,
                      index_n_heads=spec.index_n_heads)
        if spec.family == "glm" and spec.indexer_pattern is not None:
            config["index_topk_pattern"] = spec.indexer_pattern
    return config


def write_deepseek_checkpoint(path: str | Path, spec: DeepseekCheckpointSpec) -> Path:
    """Write ``spec``'s random checkpoint (bf16 weights) into directory ``path`` (created; it
    must not hold a ``config.json`` yet) and return it. Same ``spec``, same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(path)
    if (out / "config.json").exists():
        raise ValueError(f"write_deepseek_checkpoint: {out} already holds a checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="app-dsk-") as tmp:
        hub = Path(tmp) / "hub"
        hub.mkdir()
        (hub / "config.json").write_text(json.dumps(hub_config(spec), indent=2) + "\n")
        config = AutoConfig.from_pretrained(hub)          # transformers reads the Hub layout
        torch.manual_seed(spec.seed)
        auto: Any = AutoModelForCausalLM      # typed only where transformers is installed
        model = auto.from_config(config)
        _randomize_indexer_norms(model, spec.seed)
        model = model.to(torch.bfloat16)
        saved = Path(tmp) / "saved"
        model.save_pretrained(saved)                       # transformers' own layout
        for item in saved.iterdir():
            if item.name != "config.json" or spec.layout == "transformers":
                shutil.copy2(item, out / item.name)
        if spec.layout == "hub":
            shutil.copy2(hub / "config.json", out / "config.json")
    return out


def _randomize_indexer_norms(model: Any, seed: int) -> None:
    """The indexer's key LayerNorm drawn around its identity, so a bias or a scale that is
    dropped shows."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".indexer.k_norm." in name:
                noise = torch.randn(param.shape, generator=gen) * 0.2
                param.copy_((1.0 + noise) if name.endswith("weight") else noise)


def transformers_greedy(path: str | Path, prompts: list[list[int]], max_tokens: int
                        ) -> list[dict[str, list[Any]]]:
    """transformers' own float32 answer for checkpoint ``path``: per prompt (token ids), the
    greedy continuation of ``max_tokens`` tokens and the prompt logprobs (of each prompt token
    after the first, given the ones before it)."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = loaded.eval()
    # transformers renamed past_key_values to cache (5.19 has the old name, 5.24 the new one
    # and warns that the old goes in 5.40)
    cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                else "past_key_values")
    out: list[dict[str, list[Any]]] = []
    with torch.no_grad():
        for prompt in prompts:
            step = model(torch.tensor([prompt]), use_cache=True)
            logprobs = torch.log_softmax(step.logits[0].float(), dim=-1)
            tokens: list[int] = []
            for _ in range(max_tokens):    # greedy, no EOS stop (as vLLM's ignore_eos)
                tokens.append(int(step.logits[0, -1].argmax()))
                if len(tokens) < max_tokens:
                    step = model(torch.tensor([tokens[-1:]]), use_cache=True,
                                 **{cache_kw: step[cache_kw]})
            out.append({"tokens": tokens,
                        "prompt_logprobs": [float(logprobs[i, prompt[i + 1]])
                                            for i in range(len(prompt) - 1)]})
    return out
