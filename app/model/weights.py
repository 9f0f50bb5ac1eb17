"""The weights of a DeepSeek-V2/V3 model, in the layout the engine computes with.

Names and shapes follow the Hugging Face checkpoints (``D = hidden_size``, ``H`` heads,
``P/R/V`` the nope/rope/value head dims, ``L = kv_lora_rank``, ``Q = q_lora_rank``, ``I`` an
MLP's intermediate size, ``E`` routed experts), with two changes a loader makes as it copies:
the SwiGLU gate and up projections are one ``gate_up_proj [2I, D]`` (gate rows first), and a
MoE layer's experts are stacked (``experts.gate_up_proj [E, 2I, D]``, ``experts.down_proj
[E, D, I]``), as transformers 5 holds them.

FP8 e4m3 block quantization as DeepSeek-V3 ships a weight (``dequantize_fp8_block``,
``quantize_fp8_block``, ``scale_shape``): see ``app.model.loader``.

``weight_specs(config)`` lists every tensor (canonical name -> shape, and whether it is kept in
float32 whatever the model dtype: the router and its score bias, as transformers keeps them);
``ModelWeights.from_tensors`` assembles them. Loaders (``app.model.loader``) and random
weights (``app.model.random``) both fill that dict.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from app.model.config import DeepseekConfig
from app.model.sparse.weights import IndexerWeights, indexer_tensor_shapes

__all__ = [
    "FP8_E4M3_MAX",
    "AttentionWeights",
    "LayerWeights",
    "MLPWeights",
    "MoEWeights",
    "ModelWeights",
    "WeightSpec",
    "dequantize_fp8_block",
    "quantize_fp8_block",
    "scale_shape",
    "weight_specs",
]


@attrs.frozen
class WeightSpec:
    """One tensor of the model: its shape and whether it stays float32."""

    shape: tuple[int, ...]
    float32: bool = False


def _mlp_specs(prefix: str, hidden: int, inter: int) -> dict[str, WeightSpec]:
    return {f"{prefix}.gate_up_proj.weight": WeightSpec((2 * inter, hidden)),
            f"{prefix}.down_proj.weight": WeightSpec((hidden, inter))}


def _attention_specs(c: DeepseekConfig, prefix: str) -> dict[str, WeightSpec]:
    h, d = c.num_attention_heads, c.hidden_size
    q_out = h * c.qk_head_dim
    specs: dict[str, WeightSpec] = {}
    if c.q_lora_rank is None:
        specs[f"{prefix}.q_proj.weight"] = WeightSpec((q_out, d))
    else:
        specs[f"{prefix}.q_a_proj.weight"] = WeightSpec((c.q_lora_rank, d))
        specs[f"{prefix}.q_a_layernorm.weight"] = WeightSpec((c.q_lora_rank,))
        specs[f"{prefix}.q_b_proj.weight"] = WeightSpec((q_out, c.q_lora_rank))
    specs[f"{prefix}.kv_a_proj_with_mqa.weight"] = WeightSpec(
        (c.kv_lora_rank + c.qk_rope_head_dim, d))
    specs[f"{prefix}.kv_a_layernorm.weight"] = WeightSpec((c.kv_lora_rank,))
    specs[f"{prefix}.kv_b_proj.weight"] = WeightSpec(
        (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
    specs[f"{prefix}.o_proj.weight"] = WeightSpec((d, h * c.v_head_dim))
    return specs


def weight_specs(config: DeepseekConfig) -> dict[str, WeightSpec]:
    """Every tensor of ``config``'s model by canonical name (see the module docstring); the LM
    head is absent when the config ties it to the embedding."""
    c = config
    d = c.hidden_size
    specs = {"model.embed_tokens.weight": WeightSpec((c.vocab_size, d))}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        specs[f"{p}.input_layernorm.weight"] = WeightSpec((d,))
        specs.update(_attention_specs(c, f"{p}.self_attn"))
        if c.indexer is not None and c.q_lora_rank is not None and c.indexer.has_indexer(i):
            specs.update({f"{p}.self_attn.indexer.{name}": WeightSpec(shape, float32=f32)
                          for name, (shape, f32) in indexer_tensor_shapes(
                              c.indexer, hidden_size=d, q_lora_rank=c.q_lora_rank).items()})
        specs[f"{p}.post_attention_layernorm.weight"] = WeightSpec((d,))
        moe = c.moe
        if moe is None or not c.is_moe_layer(i):
            specs.update(_mlp_specs(f"{p}.mlp", d, c.intermediate_size))
            continue
        e, inter = moe.n_routed_experts, moe.moe_intermediate_size
        specs[f"{p}.mlp.gate.weight"] = WeightSpec((e, d), float32=True)
        if moe.scoring_func == "sigmoid":
            specs[f"{p}.mlp.gate.e_score_correction_bias"] = WeightSpec((e,), float32=True)
        specs[f"{p}.mlp.experts.gate_up_proj"] = WeightSpec((e, 2 * inter, d))
        specs[f"{p}.mlp.experts.down_proj"] = WeightSpec((e, d, inter))
        if moe.n_shared_experts:
            specs.update(_mlp_specs(f"{p}.mlp.shared_experts", d,
                                    inter * moe.n_shared_experts))
    specs["model.norm.weight"] = WeightSpec((d,))
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = WeightSpec((c.vocab_size, d))
    return specs


@attrs.frozen(eq=False)
class AttentionWeights:
    """One MLA layer: ``q_proj [H*(P+R), D]`` or the q LoRA (``q_a_proj [Q, D]``,
    ``q_a_layernorm [Q]``, ``q_b_proj [H*(P+R), Q]``); ``kv_a_proj [L+R, D]`` (the latent,
    then the shared rope key), ``kv_a_layernorm [L]``, ``kv_b_proj [H*(P+V), L]`` (per head: the
    key's nope part, then the value), ``o_proj [D, H*V]``; ``indexer``: DeepSeek Sparse
    Attention's lightning indexer (``app.model.sparse``; None without one)."""

    kv_a_proj: torch.Tensor
    kv_a_layernorm: torch.Tensor
    kv_b_proj: torch.Tensor
    o_proj: torch.Tensor
    q_proj: torch.Tensor | None = None
    q_a_proj: torch.Tensor | None = None
    q_a_layernorm: torch.Tensor | None = None
    q_b_proj: torch.Tensor | None = None
    indexer: IndexerWeights | None = None


@attrs.frozen(eq=False)
class MLPWeights:
    """A SwiGLU MLP: ``gate_up_proj [2I, D]`` (gate rows, then up rows), ``down_proj [D, I]``;
    ``down(silu(gate x) * up x)``."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    @property
    def intermediate_size(self) -> int:
        """``I``."""
        return int(self.down_proj.shape[1])


@attrs.frozen(eq=False)
class MoEWeights:
    """A MoE layer: the router ``gate [E, D]`` float32 (and V3's ``score_bias [E]`` float32,
    ``e_score_correction_bias``), the stacked routed experts ``experts_gate_up [E, 2I, D]`` and
    ``experts_down [E, D, I]``, and the shared experts (one SwiGLU MLP, or None)."""

    gate: torch.Tensor
    score_bias: torch.Tensor | None
    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor
    shared: MLPWeights | None


@attrs.frozen(eq=False)
class LayerWeights:
    """A decoder layer: RMSNorm, attention, RMSNorm, MLP (dense or MoE)."""

    input_layernorm: torch.Tensor
    attention: AttentionWeights
    post_attention_layernorm: torch.Tensor
    mlp: MLPWeights | MoEWeights


def _mlp(t: Mapping[str, torch.Tensor], prefix: str) -> MLPWeights:
    return MLPWeights(gate_up_proj=t[f"{prefix}.gate_up_proj.weight"],
                      down_proj=t[f"{prefix}.down_proj.weight"])


def _layer(c: DeepseekConfig, t: Mapping[str, torch.Tensor], i: int) -> LayerWeights:
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    attention = AttentionWeights(
        kv_a_proj=t[f"{a}.kv_a_proj_with_mqa.weight"],
        kv_a_layernorm=t[f"{a}.kv_a_layernorm.weight"],
        kv_b_proj=t[f"{a}.kv_b_proj.weight"], o_proj=t[f"{a}.o_proj.weight"],
        q_proj=t.get(f"{a}.q_proj.weight"), q_a_proj=t.get(f"{a}.q_a_proj.weight"),
        q_a_layernorm=t.get(f"{a}.q_a_layernorm.weight"), q_b_proj=t.get(f"{a}.q_b_proj.weight"),
        indexer=IndexerWeights.from_tensors(t, f"{a}.indexer")
        if c.indexer is not None and c.indexer.has_indexer(i) else None)
    mlp: MLPWeights | MoEWeights
    if c.is_moe_layer(i):
        shared = f"{p}.mlp.shared_experts.gate_up_proj.weight"
        mlp = MoEWeights(gate=t[f"{p}.mlp.gate.weight"],
                         score_bias=t.get(f"{p}.mlp.gate.e_score_correction_bias"),
                         experts_gate_up=t[f"{p}.mlp.experts.gate_up_proj"],
                         experts_down=t[f"{p}.mlp.experts.down_proj"],
                         shared=_mlp(t, f"{p}.mlp.shared_experts") if shared in t else None)
    else:
        mlp = _mlp(t, f"{p}.mlp")
    return LayerWeights(input_layernorm=t[f"{p}.input_layernorm.weight"], attention=attention,
                        post_attention_layernorm=t[f"{p}.post_attention_layernorm.weight"],
                        mlp=mlp)


@attrs.frozen(eq=False)
class ModelWeights:
    """A whole model: ``embed_tokens [vocab, D]``, the decoder layers, the final ``norm [D]``
    and ``lm_head [vocab, D]`` (the embedding itself when the config ties them). Tensors are
    in the model ``dtype`` (the router in float32), on the CPU unless moved."""

    config: DeepseekConfig
    embed_tokens: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor

    @classmethod
    def from_tensors(cls, config: DeepseekConfig, tensors: Mapping[str, torch.Tensor]
                     ) -> ModelWeights:
        """Assemble from canonical names (``weight_specs``); ``ValueError`` when one is missing
        or has the wrong shape."""
        specs = weight_specs(config)
        for name, spec in specs.items():
            if name not in tensors:
                raise ValueError(f"ModelWeights: tensor {name!r} is missing")
            if tuple(tensors[name].shape) != spec.shape:
                raise ValueError(f"ModelWeights: tensor {name!r} has shape "
                                 f"{list(tensors[name].shape)}, expected {list(spec.shape)}")
        embed = tensors["model.embed_tokens.weight"]
        return cls(config=config, embed_tokens=embed,
                   layers=tuple(_layer(config, tensors, i)
                                for i in range(config.num_hidden_layers)),
                   norm=tensors["model.norm.weight"],
                   lm_head=embed if config.tie_word_embeddings else tensors["lm_head.weight"])

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype (the embedding's)."""
        return self.embed_tokens.dtype

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor (the tied LM head once)."""
        seen: dict[int, torch.Tensor] = {}
        stack: list[object] = [self.embed_tokens, self.norm, self.lm_head, *self.layers]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                seen.setdefault(id(item), item)
            elif attrs.has(type(item)):
                fields = attrs.fields(type(item))  # type: ignore[arg-type]
                stack.extend(getattr(item, f.name) for f in fields if f.name != "config")
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every distinct tensor."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


# -- FP8 e4m3 block quantization (see the module docstring) ----------------------------

#: The largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
#: Elements dequantized at once (bounds the float32 temporaries, whatever the block size).
_DEQUANT_CHUNK_ELEMENTS = 1 << 22


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a ``[out, in]`` weight with ``(bo, bi)`` blocks."""
    out, inp = shape
    return -(-out // block[0]), -(-inp // block[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """``out [out, in]`` (any float dtype) = ``weight`` (float8_e4m3fn) times its block scales
    ``scale_inv``; ``ValueError`` on a dtype or shape mismatch. Returns ``out``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    expected = scale_shape((int(weight.shape[0]), int(weight.shape[1])), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of a {list(weight.shape)} weight with "
                         f"{list(block)} blocks must be {list(expected)}, got "
                         f"{list(scale_inv.shape)}")
    if tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"out must be {list(weight.shape)}, got {list(out.shape)}")
    bo, bi = block
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    scales = scale_inv.float()
    # Each element's scale gathered by its block index: the temporaries are the chunk's size,
    # however large the blocks (expanding the scales by the block size first made a 74 KB
    # checkpoint with a huge weight_block_size ask for gigabytes).
    column_blocks = torch.arange(cols) // bi
    step = max(1, min(rows, _DEQUANT_CHUNK_ELEMENTS // max(cols, 1)))
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        s = scales.index_select(0, torch.arange(r0, r1) // bo).index_select(1, column_blocks)
        out[r0:r1].copy_(weight[r0:r1].float() * s)
    return out


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [out, in], scale_inv [ceil(out/bo), ceil(in/bi)] float32)`` of a 2-D float
    ``weight``: each block scaled so its largest magnitude maps to ``FP8_E4M3_MAX``."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"expected a 2-D float weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    n_r, n_c = scale_shape((rows, cols), block)
    # A block larger than the weight is the whole weight (one block row or column): padding
    # to the block's own size would allocate for nothing.
    bo, bi = min(block[0], rows), min(block[1], cols)
    padded = torch.zeros(n_r * bo, n_c * bi, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(n_r, bo, n_c, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_E4M3_MAX
    scaled = blocks / scale_inv[:, None, :, None]
    fp8 = scaled.reshape(n_r * bo, n_c * bi)[:rows, :cols].to(torch.float8_e4m3fn)
    return fp8.contiguous(), scale_inv
