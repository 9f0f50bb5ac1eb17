"""The lightning indexer's key cache as a KV-cache spec, bound the way any third party binds one.

``IndexerKeyCacheSpec`` is one layer's indexer keys: one vector of ``head_size``
(``index_head_dim``) values per token, no value part, ``block_size * head_size * dtype_size``
bytes per block. It is a full-attention spec (blocks are held until the request ends) and is
bound to ``FullAttentionManager`` with ``FullAttentionSpec`` as its uniform base through the
spec registry's own API (``register_indexer_key_cache_spec(bindings)``: what a plugin calls;
``app.kvcache.register_kv_cache_spec`` is the same for the active container), not in the
built-in list. Sharing that base, the indexer layers and the MLA latent layers form **one**
KV-cache group: one block table per request for both caches, so block ``b`` of a request
holds the same tokens in both and everything the manager does to a block (a prefix-cache hit,
a preemption's free, a speculative step's rolled-back slots) happens to both at once. That is
vLLM's choice too (its DeepSeek-V3.2 indexer cache is an ``MLAAttentionSpec`` of its own head
size in the latent layers' group); a group of its own would need a second block table kept in
step by hand.

``sparse_kv_cache_specs(indexer, model, ...)`` lists a sparse model's layers: the latent cache
of every layer (``model.layers.{i}.self_attn``) and the key cache of every layer with an
indexer (``model.layers.{i}.self_attn.indexer``); ``model_kv_cache_specs`` any model's (what
the engine groups), binding the key cache's spec in the bindings it is given.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from app.kvcache.bindings import KVCacheSpecBindings
from app.kvcache.managers import FullAttentionManager
from app.kvcache.specs import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, to_kv_dtype
from app.model.config import DeepseekConfig
from app.model.sparse.config import IndexerConfig

__all__ = ["IndexerKeyCacheSpec", "indexer_layer_name", "model_kv_cache_specs",
           "register_indexer_key_cache_spec", "sparse_kv_cache_specs"]


def _one_head(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if value != 1 or isinstance(value, bool):
        raise ValueError(f"{type(instance).__name__}.num_kv_heads: the indexer keeps one key "
                         f"per token (1), got {value!r}")


@attrs.frozen(kw_only=True)
class IndexerKeyCacheSpec(FullAttentionSpec):
    """One layer's indexer key cache: ``head_size`` (``index_head_dim``) values per token."""

    num_kv_heads: int = attrs.field(default=1, validator=_one_head)

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * head_size * dtype_size`` (one key per token, no value)."""
        return self.block_size * self.head_size * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """``head_size * dtype_size``."""
        return self.head_size * self.dtype.itemsize

    @classmethod
    def from_dims(cls, *, block_size: int, index_head_dim: int,
                  dtype: torch.dtype | str) -> IndexerKeyCacheSpec:
        """The spec of a key cache of ``index_head_dim`` values per token."""
        return cls(block_size=block_size, head_size=index_head_dim, dtype=to_kv_dtype(dtype))


def register_indexer_key_cache_spec(bindings: KVCacheSpecBindings) -> None:
    """Bind ``IndexerKeyCacheSpec`` in ``bindings`` (a container's) to ``FullAttentionManager``
    with ``FullAttentionSpec`` as its uniform base (again: a no-op)."""
    bindings.register(IndexerKeyCacheSpec, FullAttentionManager, FullAttentionSpec)


def indexer_layer_name(layer: int) -> str:
    """The key cache's layer name: ``model.layers.{layer}.self_attn.indexer``."""
    return f"model.layers.{layer}.self_attn.indexer"


def sparse_kv_cache_specs(indexer: IndexerConfig, model: Any, *, num_layers: int,
                          block_size: int, dtype: torch.dtype | None = None,
                          kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
    """``{layer name: spec}`` of a sparse model (``model``: its ``ModelConfig``; ``dtype``: the
    caches' dtype, default the model's; ``kv_cache_dtype``: the latent cache's, as
    ``MLAAttentionSpec.from_dims`` takes it): the latent cache of every layer, then the key
    cache of every layer with an indexer of its own (always in ``dtype``)."""
    cache_dtype = model.dtype if dtype is None else dtype
    latent = MLAAttentionSpec.from_model_config(model, block_size=block_size, dtype=cache_dtype,
                                                kv_cache_dtype=kv_cache_dtype)
    keys = IndexerKeyCacheSpec.from_dims(block_size=block_size,
                                         index_head_dim=indexer.index_head_dim,
                                         dtype=cache_dtype)
    specs: dict[str, KVCacheSpec] = {f"model.layers.{i}.self_attn": latent
                                     for i in range(num_layers)}
    specs.update({indexer_layer_name(i): keys for i in range(num_layers)
                  if indexer.has_indexer(i)})
    return specs


def model_kv_cache_specs(arch: DeepseekConfig, model: Any, *, block_size: int,
                         bindings: KVCacheSpecBindings,
                         kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
    """Every layer's KV-cache spec of the model ``arch`` describes (``model``: the engine's
    ``ModelConfig``): one ``MLAAttentionSpec`` per layer (its latent cache in
    ``kv_cache_dtype``, ``app.config.KV_CACHE_DTYPES``), and for a sparse model the key cache
    of every layer with an indexer, its spec first bound in ``bindings``
    (``register_indexer_key_cache_spec``)."""
    if arch.indexer is None:
        latent = MLAAttentionSpec.from_model_config(model, block_size=block_size,
                                                    kv_cache_dtype=kv_cache_dtype)
        return {f"model.layers.{i}.self_attn": latent for i in range(arch.num_hidden_layers)}
    register_indexer_key_cache_spec(bindings)
    return sparse_kv_cache_specs(arch.indexer, model, num_layers=arch.num_hidden_layers,
                                 block_size=block_size, kv_cache_dtype=kv_cache_dtype)
