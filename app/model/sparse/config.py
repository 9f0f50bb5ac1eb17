"""DeepSeek Sparse Attention in a ``config.json``: DeepSeek-V3.2 (``deepseek_v32``) and GLM-5
(``glm_moe_dsa``), as transformers (>= 5.23) reads them.

Every MLA layer of these models has a lightning indexer (``IndexerConfig``): ``index_n_heads``
query heads and one key of ``index_head_dim`` values per token, whose first
``qk_rope_head_dim`` values are roped (V3.2: halves, ``rotate_half``; GLM-5: adjacent pairs),
scoring every visible token; attention then reads only the ``index_topk`` best. GLM-5 may mark
layers ``shared`` (``indexer_types``, else ``index_topk_pattern``, else the
``index_topk_freq`` / ``index_skip_topk_offset`` schedule): such a layer has no indexer of its
own and reuses the previous layer's selection. The main MLA always ropes adjacent pairs and
always has a q LoRA (the indexer reads its normed residual); ``mlp_layer_types``, where a
config writes it, must be what ``first_k_dense_replace`` / ``moe_layer_freq`` say.
``index_topk`` is at most ``max_position_embeddings``: the model's context, so the most keys
one of its queries sees; a larger top-k selects nothing more (transformers takes
``min(index_topk, T)``) and only stands for an absurd number.
``read_indexer`` reads all of it (``ValueError`` naming the file and the key).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

__all__ = ["SPARSE_ARCHITECTURES", "SPARSE_DEFAULTS", "IndexerConfig", "read_indexer"]

#: The sparse architectures, and their ``model_type``.
SPARSE_ARCHITECTURES: dict[str, str] = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
_COMMON = {"hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": False,
           "rope_interleave": True, "first_k_dense_replace": 3, "moe_layer_freq": 1,
           "n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc",
           "scoring_func": "sigmoid", "norm_topk_prob": True, "num_nextn_predict_layers": 0,
           "index_topk": 2048, "index_head_dim": 128}
#: transformers' defaults for the keys a sparse config may omit.
SPARSE_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV32ForCausalLM": {**_COMMON, "rms_norm_eps": 1e-6, "n_group": 8, "topk_group": 4,
                               "max_position_embeddings": 163840, "index_n_heads": 64},
    "GlmMoeDsaForCausalLM": {**_COMMON, "rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1,
                             "max_position_embeddings": 202752, "index_n_heads": 32},
}
_INDEXER_TYPES = {"full": True, "shared": False, "F": True, "S": False}


class _Reads(Protocol):
    """What ``read_indexer`` needs of the config reader (``app.model.config``'s)."""

    source: str
    raw: Mapping[str, Any]

    def integer(self, key: str, minimum: int = 1) -> int: ...

    def boolean(self, key: str) -> bool: ...

    def error(self, key: str, expected: str) -> ValueError: ...


@attrs.frozen(kw_only=True)
class IndexerConfig:
    """The lightning indexer of every layer (see the module docstring): ``index_topk`` tokens
    attended per query, ``index_n_heads`` heads of ``index_head_dim``, the rope layout of its
    roped dims (``rope_interleave``: adjacent pairs, GLM-5; else halves, V3.2) and, per layer,
    whether it has an indexer of its own (``layer_has_indexer``; a shared layer reuses the
    previous layer's selection; layer 0 always has one)."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    rope_interleave: bool = False
    layer_has_indexer: tuple[bool, ...] = ()

    def __attrs_post_init__(self) -> None:
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IndexerConfig.{name} must be an int >= 1, got {value!r}")
        if self.layer_has_indexer and not self.layer_has_indexer[0]:
            raise ValueError("IndexerConfig.layer_has_indexer: layer 0 must have an indexer "
                             "(a shared layer reuses the previous layer's selection)")

    def has_indexer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs an indexer of its own."""
        return self.layer_has_indexer[layer] if self.layer_has_indexer else True

    @property
    def weights_scale(self) -> float:
        """What the per-head weights are multiplied by: ``index_n_heads ** -0.5 *
        index_head_dim ** -0.5`` (transformers applies the second inside the relu)."""
        return float(self.index_n_heads ** -0.5 * self.index_head_dim ** -0.5)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        return {"index_topk": self.index_topk, "index_head_dim": self.index_head_dim,
                "index_n_heads": self.index_n_heads, "rope_interleave": self.rope_interleave,
                "shared_layers": [i for i, own in enumerate(self.layer_has_indexer) if not own]}


def read_indexer(architecture: str, r: _Reads, *, num_layers: int, qk_rope_head_dim: int,
                 q_lora_rank: int | None, first_k_dense_replace: int, moe_layer_freq: int,
                 moe: bool) -> IndexerConfig | None:
    """The indexer of a sparse ``architecture`` (None for a dense one), after checking what
    the sparse architectures fix (see the module docstring)."""
    if architecture not in SPARSE_ARCHITECTURES:
        return None
    _check_mlp_layer_types(r, num_layers, first_k_dense_replace, moe_layer_freq, moe)
    if not r.boolean("rope_interleave"):
        raise r.error("rope_interleave", f"true: {architecture}'s MLA ropes adjacent pairs "
                      "(transformers ignores this key for it)")
    if q_lora_rank is None:
        raise r.error("q_lora_rank", "an int: the indexer reads the q LoRA's normed residual")
    head_dim = r.integer("index_head_dim")
    if head_dim < qk_rope_head_dim:
        raise r.error("index_head_dim", f"an int >= qk_rope_head_dim ({qk_rope_head_dim}): "
                      "its first qk_rope_head_dim values are roped")
    glm = architecture == "GlmMoeDsaForCausalLM"
    topk, positions = r.integer("index_topk"), r.integer("max_position_embeddings")
    # The bound the model implies: a query of its context sees at most max_position_embeddings
    # keys (V3.2: 2048 of 163840, GLM-5: 2048 of 202752). The engine sizes a step's tensors by
    # min(index_topk, the step's keys) whatever this says; the load refuses what is no top-k.
    if topk > positions:
        raise r.error("index_topk", f"an int in [1, max_position_embeddings = {positions}]: "
                      "a query sees at most the model's context, so a larger top-k selects "
                      "nothing more")
    return IndexerConfig(index_topk=topk, index_head_dim=head_dim,
                         index_n_heads=r.integer("index_n_heads"), rope_interleave=glm,
                         layer_has_indexer=_layer_types(r, num_layers) if glm
                         else (True,) * num_layers)


def _layer_types(r: _Reads, num_layers: int) -> tuple[bool, ...]:
    """GLM-5's per-layer indexer modes, as transformers derives them."""
    raw = r.raw
    if raw.get("indexer_types") is not None:
        key, given = "indexer_types", raw["indexer_types"]
    elif raw.get("index_topk_pattern") is not None:
        key, given = "index_topk_pattern", raw["index_topk_pattern"]
    else:
        freq = max(r.integer("index_topk_freq") if "index_topk_freq" in raw else 1, 1)
        offset = r.integer("index_skip_topk_offset", 0) if "index_skip_topk_offset" in raw \
            else 2
        schedule = tuple(max(i - offset + 1, 0) % freq == 0 for i in range(num_layers))
        if not schedule[0]:
            raise r.error("index_skip_topk_offset", f"an offset whose schedule (every "
                          f"{freq} layers) runs layer 0's indexer: a shared layer reuses the "
                          "previous layer's selection")
        return schedule
    if isinstance(given, str) and key == "index_topk_pattern":
        given = list(given)
    if not (isinstance(given, list) and len(given) == num_layers
            and all(isinstance(v, str) and v in _INDEXER_TYPES for v in given)):
        raise r.error(key, f"{num_layers} entries (one per layer), each 'full' or 'shared'"
                      + (" ('F' or 'S' in a pattern)" if key == "index_topk_pattern" else ""))
    types = tuple(_INDEXER_TYPES[v] for v in given)
    if types and not types[0]:
        raise r.error(key, "layer 0 'full': a shared layer reuses the previous layer's "
                      "selection")
    return types


def _check_mlp_layer_types(r: _Reads, num_layers: int, first_dense: int, freq: int,
                           moe: bool) -> None:
    given = r.raw.get("mlp_layer_types")
    if given is None:
        return
    want = ["sparse" if moe and i >= first_dense and i % freq == 0 else "dense"
            for i in range(num_layers)]
    if given != want:
        raise r.error("mlp_layer_types", f"{want} (what first_k_dense_replace = "
                      f"{first_dense} and moe_layer_freq = {freq} say; another pattern is not "
                      "supported)")
