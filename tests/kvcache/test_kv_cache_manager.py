"""KVCacheManager end to end: hits, allocation failure without leaks, hybrid groups, MLA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.config import CacheConfig
from app.kvcache import (
    CacheHit,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheRequest,
    KVCacheSpecBindings,
    KVCacheSpecRegistry,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)


def bindings() -> KVCacheSpecBindings:
    """The bindings of the active container (the fixture's fresh one)."""
    return KVCacheSpecRegistry.bindings()

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
BS = 4


def full_manager(num_blocks: int = 32, caching: bool = True) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, **ATTN)
    return KVCacheManager.from_specs({"l0": spec, "l1": spec}, CacheConfig(
        block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching), bindings=bindings())


def schedule(manager: KVCacheManager, req: KVCacheRequest) -> CacheHit | None:
    hit = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens, hit)
    if new is None:
        return None
    manager.cache_blocks(req, req.num_tokens)
    return hit


def test_prefix_hit_reports_computed_tokens() -> None:
    manager = full_manager()
    a = manager.new_request("a", range(10))
    hit = schedule(manager, a)
    assert hit is not None and hit.num_computed_tokens == 0
    assert a.num_computed_tokens == 10
    b = manager.new_request("b", [*range(10), 50, 51, 52])
    hit_b = manager.get_computed_blocks(b)
    assert hit_b.num_computed_tokens == 8  # two full cached blocks
    assert hit_b.get_block_ids() == (manager.get_block_ids("a")[0][:2],)
    new = manager.allocate_slots(b, b.num_tokens - 8, hit_b)
    assert new is not None and b.num_computed_tokens == 8
    assert len(manager.get_block_ids("b")[0]) == 4 and new.num_blocks == 2
    assert manager.get_block_ids("b")[0][:2] == manager.get_block_ids("a")[0][:2]
    assert manager.prefix_cache_hit_rate > 0


def test_hit_leaves_the_last_token_to_compute() -> None:
    manager = full_manager()
    schedule(manager, manager.new_request("a", range(8)))
    again = manager.new_request("b", range(8))
    assert manager.get_computed_blocks(again).num_computed_tokens == 4


def test_allocation_failure_leaks_nothing() -> None:
    manager = full_manager(num_blocks=6)  # 5 usable blocks
    a = manager.new_request("a", range(12))
    assert schedule(manager, a) is not None
    free_before = manager.num_free_blocks
    b = manager.new_request("b", list(range(8)) + list(range(100, 112)))  # hit 8, needs 3 more
    hit = manager.get_computed_blocks(b)
    assert hit.num_computed_tokens == 8
    assert manager.allocate_slots(b, b.num_tokens - 8, hit) is None
    assert manager.num_free_blocks == free_before
    assert not manager.holds("b") and b.num_computed_tokens == 0
    assert [blk.ref_cnt for blk in hit.blocks[0]] == [1, 1]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 5 and a.num_computed_tokens == 0
    manager.block_pool.check_consistency()


def test_decode_steps_and_cached_blocks_survive_free() -> None:
    manager = full_manager()
    req = manager.new_request("a", range(6))
    schedule(manager, req)
    for token in range(6, 12):
        req.append_token_ids(token)
        assert manager.allocate_slots(req, 1) is not None
        manager.cache_blocks(req, req.num_tokens)
    assert len(manager.get_block_ids("a")[0]) == 3
    assert manager.block_pool.num_cached_blocks == 3
    manager.free(req)
    assert manager.block_pool.num_cached_blocks == 3
    assert manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 0


def test_caching_off_means_no_hits() -> None:
    manager = full_manager(caching=False)
    schedule(manager, manager.new_request("a", range(10)))
    assert manager.get_computed_blocks(manager.new_request("b", range(10))).num_computed_tokens == 0


def test_request_checks() -> None:
    manager = full_manager()
    wrong = KVCacheRequest("x", range(8), hash_block_size=8)
    with pytest.raises(ValueError, match=r"hashes blocks of 8"):
        manager.get_computed_blocks(wrong)
    req = manager.new_request("a", range(8))
    schedule(manager, req)
    fresh = manager.new_request("a2", range(8))
    hit = manager.get_computed_blocks(fresh)
    with pytest.raises(ValueError, match="new request"):
        manager.allocate_slots(req, 1, hit)
    with pytest.raises(ValueError):
        manager.allocate_slots(req, -1)
    with pytest.raises(ValueError):
        manager.cache_blocks(req, 100)
    manager.free("a")
    with pytest.raises(ValueError):
        KVCacheManager([], CacheConfig(), bindings=bindings())
    with pytest.raises(TypeError):
        KVCacheRequest("", [1])
    with pytest.raises(TypeError):
        KVCacheRequest("r", ["a"])  # type: ignore[list-item]


def test_running_request_cannot_be_looked_up_again() -> None:
    manager = full_manager()
    req = manager.new_request("a", range(8))
    manager.allocate_slots(req, 8)
    with pytest.raises(ValueError, match="already holds"):
        manager.get_computed_blocks(req)


def test_cache_salt_isolates_prefixes() -> None:
    manager = full_manager()
    schedule(manager, manager.new_request("a", range(12), cache_salt="tenant-1"))
    same = manager.new_request("b", range(12), cache_salt="tenant-1")
    other = manager.new_request("c", range(12), cache_salt="tenant-2")
    assert manager.get_computed_blocks(same).num_computed_tokens == 8
    assert manager.get_computed_blocks(other).num_computed_tokens == 0


def test_hybrid_full_and_sliding_window_hit_converges() -> None:
    full = FullAttentionSpec(block_size=BS, **ATTN)
    sw = SlidingWindowSpec(block_size=BS, sliding_window=8, **ATTN)
    manager = KVCacheManager.from_specs({"f": full, "s": sw},
                                        CacheConfig(block_size=BS, num_blocks=64),
                                        bindings=bindings())
    assert len(manager.managers) == 2
    a = manager.new_request("a", range(24))
    schedule(manager, a)
    # The sliding-window group drops its out-of-window blocks on the next step.
    a.append_token_ids(24)
    manager.allocate_slots(a, 1)
    assert manager.get_block_ids("a")[1][0] == 0  # replaced by the null block
    b = manager.new_request("b", [*range(24), 7, 7])
    hit = manager.get_computed_blocks(b)
    # Full attention hits 6 blocks; sliding window needs blocks 4, 5 (cached) -> 24 tokens.
    assert hit.num_computed_tokens == 24
    assert len(hit.blocks[0]) == 6 and len(hit.blocks[1]) == 6
    assert manager.allocate_slots(b, 2, hit) is not None
    manager.free(a)
    manager.free(b)
    manager.block_pool.check_consistency()
    assert manager.num_free_blocks == 63


def test_mla_single_group_block_table() -> None:
    spec = MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                      dtype=torch.bfloat16)
    manager = KVCacheManager.from_specs({f"layers.{i}": spec for i in range(3)},
                                        CacheConfig(block_size=16, num_blocks=64),
                                        bindings=bindings())
    assert manager.hash_block_size == 16 and len(manager.kv_cache_groups) == 1
    req = manager.new_request("r", range(40))
    hit = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens, hit)
    assert new is not None and new.get_block_ids() == ([1, 2, 3],)
    assert manager.get_block_ids("r") == ([1, 2, 3],)
    assert manager.get_blocks("r")[0][0].block_id == 1
    manager.cache_blocks(req, 40)
    manager.free(req)
    assert manager.usage == 0.0


def test_groups_with_different_block_sizes_share_hashes() -> None:
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=16, dtype=torch.float16)
    big = ChunkedLocalAttentionSpec(block_size=8, attention_chunk_size=64, **ATTN)
    manager = KVCacheManager.from_specs({"f": full, "c": big},
                                        CacheConfig(block_size=4, num_blocks=64),
                                        bindings=bindings())
    assert manager.hash_block_size == 4
    schedule(manager, manager.new_request("a", range(20)))
    hit = manager.get_computed_blocks(manager.new_request("b", range(20)))
    assert hit.num_computed_tokens == 16  # a multiple of both block sizes
    assert [len(g) for g in hit.blocks] == [4, 2]


def test_cross_attention_group_does_not_limit_hits() -> None:
    full = FullAttentionSpec(block_size=BS, **ATTN)
    cross = CrossAttentionSpec(block_size=BS, **ATTN)
    manager = KVCacheManager.from_specs({"self": full, "cross": cross},
                                        CacheConfig(block_size=BS, num_blocks=64),
                                        bindings=bindings())
    a = manager.new_request("a", range(12), num_encoder_tokens=6)
    schedule(manager, a)
    assert [len(t) for t in manager.get_block_ids("a")] == [3, 2]
    b = manager.new_request("b", range(12), num_encoder_tokens=6)
    hit = manager.get_computed_blocks(b)
    assert hit.num_computed_tokens == 8 and hit.blocks[1] == []


def test_mamba_and_sink_groups() -> None:
    mamba = MambaSpec(block_size=BS, shapes=[[4]], dtypes=["fp16"])
    manager = KVCacheManager.from_specs({"m": mamba}, CacheConfig(block_size=BS, num_blocks=16),
                                        bindings=bindings())
    req = manager.new_request("a", range(16))
    schedule(manager, req)
    assert sum(b != 0 for b in manager.get_block_ids("a")[0]) == 1
    hit = manager.get_computed_blocks(manager.new_request("b", range(20)))
    assert hit.num_computed_tokens == 16
    sink = SinkFullAttentionSpec(block_size=BS, sink_len=8, **ATTN)
    with_sink = KVCacheManager.from_specs({"s": sink},
                                          CacheConfig(block_size=BS, num_blocks=16),
                                          bindings=bindings())
    assert with_sink.num_free_blocks == 13
    schedule(with_sink, with_sink.new_request("a", range(8)))
    with_sink.free("a")
    assert with_sink.reset_prefix_cache()
