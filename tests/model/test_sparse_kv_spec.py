"""``IndexerKeyCacheSpec``: the indexer's key cache as a KV-cache spec, bound through the spec
registry's own API and grouped with the latent layers (one block table)."""

from __future__ import annotations

import pytest
import torch

from app.config import ModelConfig
from app.kvcache import (
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheSpecBindings,
    MLAAttentionSpec,
    SlidingWindowManager,
    get_kv_cache_bytes_per_block,
    get_kv_cache_groups,
)
from app.model import IndexerKeyCacheSpec, register_indexer_key_cache_spec, sparse_kv_cache_specs
from app.model.sparse.config import IndexerConfig


def test_the_page_is_one_key_per_token() -> None:
    spec = IndexerKeyCacheSpec.from_dims(block_size=64, index_head_dim=128, dtype="bf16")
    assert spec.page_size_bytes == 64 * 128 * 2 and spec.bytes_per_token == 256
    assert spec.max_memory_usage_bytes(1000) == 16 * spec.page_size_bytes
    with pytest.raises(ValueError, match="one key per token"):
        IndexerKeyCacheSpec(block_size=16, head_size=128, dtype=torch.bfloat16, num_kv_heads=2)


def test_it_is_bound_as_a_plugin_binds_a_spec() -> None:
    bindings = KVCacheSpecBindings()
    assert IndexerKeyCacheSpec not in bindings.registered_specs()
    register_indexer_key_cache_spec(bindings)
    register_indexer_key_cache_spec(bindings)          # again: a no-op
    meta = bindings.registered_specs()[IndexerKeyCacheSpec]
    assert meta.manager_class is FullAttentionManager
    assert meta.uniform_type_base_spec is FullAttentionSpec
    with pytest.raises(ValueError, match="Conflicting registration"):
        bindings.register(IndexerKeyCacheSpec, SlidingWindowManager, FullAttentionSpec)


def test_a_sparse_model_s_caches_are_one_group() -> None:
    indexer = IndexerConfig(index_topk=2048, index_head_dim=128, index_n_heads=64,
                            layer_has_indexer=(True, False, True))
    model = ModelConfig(dtype=torch.bfloat16, index_topk=2048)
    specs = sparse_kv_cache_specs(indexer, model, num_layers=3, block_size=64)
    assert list(specs) == [*(f"model.layers.{i}.self_attn" for i in range(3)),
                           "model.layers.0.self_attn.indexer",
                           "model.layers.2.self_attn.indexer"]
    bindings = KVCacheSpecBindings()
    register_indexer_key_cache_spec(bindings)
    [group] = get_kv_cache_groups(specs, bindings)
    assert isinstance(group.kv_cache_spec, MLAAttentionSpec)
    assert get_kv_cache_bytes_per_block([group]) == 64 * (3 * 576 + 2 * 128) * 2
