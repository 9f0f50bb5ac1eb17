"""The lightning indexer's tensors, as DeepSeek-V3.2 / GLM-5 checkpoints name them.

Per layer with an indexer, under ``model.layers.{i}.self_attn.indexer.`` (``Q = q_lora_rank``,
``D = hidden_size``, ``Hi = index_n_heads``, ``Di = index_head_dim``): ``wq_b.weight [Hi * Di,
Q]`` (the index queries, from the q LoRA's normed residual), ``wk.weight [Di, D]`` and the
LayerNorm ``k_norm.weight`` / ``k_norm.bias [Di]`` (the index key), ``weights_proj.weight [Hi,
D]`` (a weight per head; kept in float32, as transformers keeps it). FP8 checkpoints quantize
``wq_b`` and ``wk`` as any other projection (``weight_scale_inv``).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from app.model.sparse.config import IndexerConfig

__all__ = ["IndexerWeights", "indexer_tensor_shapes"]


def indexer_tensor_shapes(indexer: IndexerConfig, *, hidden_size: int, q_lora_rank: int
                          ) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{name under the layer's indexer: (shape, kept in float32)}``."""
    hi, di = indexer.index_n_heads, indexer.index_head_dim
    return {"wq_b.weight": ((hi * di, q_lora_rank), False),
            "wk.weight": ((di, hidden_size), False),
            "k_norm.weight": ((di,), False),
            "k_norm.bias": ((di,), False),
            "weights_proj.weight": ((hi, hidden_size), True)}


@attrs.frozen(eq=False)
class IndexerWeights:
    """One layer's indexer: ``wq_b [Hi * Di, Q]``, ``wk [Di, D]``, ``k_norm_weight`` /
    ``k_norm_bias [Di]``, ``weights_proj [Hi, D]`` (float32)."""

    wq_b: torch.Tensor
    wk: torch.Tensor
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor], prefix: str) -> IndexerWeights:
        """From ``{canonical name: tensor}`` (``prefix``:
        ``model.layers.{i}.self_attn.indexer``)."""
        return cls(wq_b=t[f"{prefix}.wq_b.weight"], wk=t[f"{prefix}.wk.weight"],
                   k_norm_weight=t[f"{prefix}.k_norm.weight"],
                   k_norm_bias=t[f"{prefix}.k_norm.bias"],
                   weights_proj=t[f"{prefix}.weights_proj.weight"])
