"""Single-type managers: allocation, cache hits, skipped blocks, caching, freeing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.kvcache import (
    BlockPool,
    ChunkedLocalAttentionManager,
    ChunkedLocalAttentionSpec,
    CrossAttentionManager,
    CrossAttentionSpec,
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheRequest,
    MambaManager,
    MambaSpec,
    SinkFullAttentionManager,
    SinkFullAttentionSpec,
    SlidingWindowManager,
    SlidingWindowSpec,
)

BS = 4
ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}


def request(rid: str, n: int, start: int = 0) -> KVCacheRequest:
    return KVCacheRequest(rid, range(start, start + n), hash_block_size=BS)


def fill(manager: Any, req: KVCacheRequest) -> list[KVCacheBlock]:
    """Allocate and cache a whole request."""
    new: list[KVCacheBlock] = manager.allocate_new_blocks(req.request_id, req.num_tokens)
    manager.cache_blocks(req, req.num_tokens)
    return new


def real(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks if not b.is_null]


def test_full_attention_allocate_hit_free() -> None:
    pool = BlockPool(20)
    manager = FullAttentionManager(FullAttentionSpec(block_size=BS, **ATTN), pool)
    req = request("a", 10)
    assert manager.get_num_blocks_to_allocate("a", 10) == 3
    blocks = fill(manager, req)
    assert len(blocks) == 3 and manager.get_num_blocks_to_allocate("a", 12) == 0
    assert manager.allocate_new_blocks("a", 12) == []
    hit = manager.find_longest_cache_hit(req.block_hashes, 10)
    assert hit == blocks[:2]  # only full blocks are cached
    assert manager.find_longest_cache_hit(req.block_hashes, 7) == blocks[:1]
    manager.free("a")
    manager.free("a")  # unknown requests are a no-op
    assert pool.num_free_blocks == 19
    # Still cached after the free: a second request with the same prefix hits.
    assert manager.find_longest_cache_hit(request("b", 8).block_hashes, 8) == blocks[:2]
    # A hit sitting in the free queue counts as a block to allocate.
    assert manager.get_num_blocks_to_allocate("b", 12, blocks[:2]) == 1 + 2
    manager.add_computed_blocks("b", blocks[:2])
    assert all(b.ref_cnt == 1 for b in blocks[:2])
    with pytest.raises(ValueError, match="already holds"):
        manager.add_computed_blocks("b", blocks[:1])
    pool.check_consistency()


def test_full_attention_hit_stops_at_first_miss() -> None:
    pool = BlockPool(20)
    manager = FullAttentionManager(FullAttentionSpec(block_size=BS, **ATTN), pool)
    fill(manager, request("a", 16))
    other = request("b", 16)
    other_tokens = list(range(8)) + [99] * 8
    diverging = KVCacheRequest("c", other_tokens, hash_block_size=BS)
    assert len(manager.find_longest_cache_hit(diverging.block_hashes, 16)) == 2
    assert manager.find_longest_cache_hit(request("d", 16, start=1).block_hashes, 16) == []
    assert len(manager.find_longest_cache_hit(other.block_hashes, 16)) == 4


def test_caching_disabled_manager_never_hits() -> None:
    pool = BlockPool(20)
    manager = FullAttentionManager(FullAttentionSpec(block_size=BS, **ATTN), pool,
                                   enable_caching=False)
    req = request("a", 8)
    fill(manager, req)
    assert manager.find_longest_cache_hit(req.block_hashes, 8) == []
    assert pool.num_cached_blocks == 0


def sw_manager(pool: BlockPool, window: int = 8) -> SlidingWindowManager:
    return SlidingWindowManager(SlidingWindowSpec(block_size=BS, sliding_window=window, **ATTN),
                                pool)


def test_sliding_window_removes_blocks_out_of_the_window() -> None:
    pool = BlockPool(20)
    manager = sw_manager(pool, window=8)
    fill(manager, request("a", 20))
    assert manager.get_num_skipped_tokens(20) == 13
    manager.remove_skipped_blocks("a", 20)  # blocks 0..2 (tokens 0..11) left the window
    table = manager.get_blocks("a")
    assert [b.is_null for b in table] == [True, True, True, False, False]
    assert pool.num_free_blocks == 19 - 2
    manager.remove_skipped_blocks("a", 20)  # idempotent
    manager.remove_skipped_blocks("nobody", 20)
    assert pool.num_free_blocks == 17
    manager.free("a")
    assert pool.num_free_blocks == 19
    pool.check_consistency()


def test_sliding_window_hit_needs_a_window_of_contiguous_blocks() -> None:
    pool = BlockPool(30)
    manager = sw_manager(pool, window=8)  # needs cdiv(7, 4) = 2 contiguous blocks
    req = request("a", 24)
    blocks = fill(manager, req)
    hit = manager.find_longest_cache_hit(req.block_hashes, 24)
    assert len(hit) == 6 and [b.is_null for b in hit] == [True] * 4 + [False] * 2
    assert hit[-2:] == blocks[-2:]
    # Evict block 5 (tokens 20..23): the best hit ends at block 4 (blocks 3, 4 cached).
    pool.evict_blocks([blocks[5].block_id])
    hit = manager.find_longest_cache_hit(req.block_hashes, 24)
    assert len(hit) == 5 and real(hit) == [blocks[3].block_id, blocks[4].block_id]
    # Evict block 3 too: the right-most run of two is blocks 1, 2 (block 0 is not needed).
    pool.evict_blocks([blocks[3].block_id])
    hit = manager.find_longest_cache_hit(req.block_hashes, 24)
    assert [b.is_null for b in hit] == [True, False, False] and hit[1:] == blocks[1:3]
    assert manager.find_longest_cache_hit(req.block_hashes, 3) == []


def test_sliding_window_short_run_at_the_start_is_a_hit() -> None:
    pool = BlockPool(30)
    manager = sw_manager(pool, window=16)  # needs 4 contiguous blocks
    req = request("a", 24)
    blocks = fill(manager, req)
    pool.evict_blocks([blocks[3].block_id])
    # No run of 4 anywhere; blocks 0..2 start the sequence, so they are all still needed.
    assert manager.find_longest_cache_hit(req.block_hashes, 24) == blocks[:3]


def test_chunked_local_attention() -> None:
    pool = BlockPool(30)
    spec = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=8, **ATTN)
    manager = ChunkedLocalAttentionManager(spec, pool)
    req = request("a", 20)
    blocks = fill(manager, req)
    assert manager.get_num_skipped_tokens(13) == 8 and manager.get_num_skipped_tokens(7) == 0
    hit = manager.find_longest_cache_hit(req.block_hashes, 15)
    # tokens 0..7 are out of the chunk of token 15: nulls; block 2 (tokens 8..11) cached
    assert [b.is_null for b in hit] == [True, True, False] and hit[2] is blocks[2]
    assert all(b.is_null for b in manager.find_longest_cache_hit(req.block_hashes, 16))
    manager.remove_skipped_blocks("a", 16)
    assert [b.is_null for b in manager.get_blocks("a")] == [True] * 4 + [False]
    manager.free("a")
    pool.check_consistency()


def test_cross_attention_allocates_for_encoder_tokens_and_never_caches() -> None:
    pool = BlockPool(20)
    manager = CrossAttentionManager(CrossAttentionSpec(block_size=BS, **ATTN), pool)
    assert not manager.enable_caching
    req = KVCacheRequest("a", range(8), hash_block_size=BS, num_encoder_tokens=10)
    assert manager.num_tokens_for(req, 8) == 10
    manager.allocate_new_blocks("a", manager.num_tokens_for(req, 8))
    manager.cache_blocks(req, 8)
    assert len(manager.get_blocks("a")) == 3 and pool.num_cached_blocks == 0
    assert manager.find_longest_cache_hit(req.block_hashes, 8) == []


def test_sink_manager_reserves_sink_blocks() -> None:
    pool = BlockPool(10)
    spec = SinkFullAttentionSpec(block_size=BS, sink_len=8, **ATTN)
    manager = SinkFullAttentionManager(spec, pool)
    assert manager.sink_block_ids == [1, 2] and pool.num_free_blocks == 7
    fill(manager, request("a", 8))
    manager.free("a")
    assert pool.num_free_blocks == 7
    with pytest.raises(ValueError, match="multiple of block_size"):
        SinkFullAttentionManager(SinkFullAttentionSpec(block_size=BS, sink_len=6, **ATTN), pool)
    with pytest.raises(ValueError, match="sink blocks"):
        SinkFullAttentionManager(SinkFullAttentionSpec(block_size=BS, sink_len=64, **ATTN),
                                 BlockPool(4))
    with pytest.raises(TypeError):
        SinkFullAttentionManager(FullAttentionSpec(block_size=BS, **ATTN), pool)
    with pytest.raises(TypeError):
        SlidingWindowManager(FullAttentionSpec(block_size=BS, **ATTN), pool)
    with pytest.raises(TypeError):
        ChunkedLocalAttentionManager(FullAttentionSpec(block_size=BS, **ATTN), pool)


def test_mamba_keeps_the_running_state_and_checkpoints() -> None:
    pool = BlockPool(10)
    manager = MambaManager(MambaSpec(block_size=BS, shapes=[[2, 2]], dtypes=["fp16"]), pool)
    req = request("a", 10)
    assert manager.get_num_blocks_to_allocate("a", 10) == 1
    new = manager.allocate_new_blocks("a", 10)
    table = manager.get_blocks("a")
    assert len(new) == 1 and [b.is_null for b in table] == [True, True, False]
    manager.cache_blocks(req, 10)  # 10 is not a block boundary: nothing cached
    assert pool.num_cached_blocks == 0
    # Grow to 12 tokens in place (same last position), compute, checkpoint at 12.
    assert manager.allocate_new_blocks("a", 12) == []
    req.append_token_ids([10, 11])
    manager.cache_blocks(req, 12)
    checkpoint = table[2]
    assert pool.num_cached_blocks == 1 and checkpoint.block_hash is not None
    # Next step: a new running block at position 3; the checkpoint is read, then skipped.
    manager.allocate_new_blocks("a", 14)
    assert manager.get_num_skipped_tokens(12) == 8
    manager.remove_skipped_blocks("a", 12)
    assert sum(not b.is_null for b in manager.get_blocks("a")) == 2
    manager.remove_skipped_blocks("a", 14)
    assert sum(not b.is_null for b in manager.get_blocks("a")) == 1
    # A new request with the same prefix resumes from the checkpoint after 12 tokens.
    other = request("b", 16)
    hit = manager.find_longest_cache_hit(other.block_hashes, 15)
    assert len(hit) == 3 and hit[-1] is checkpoint and all(b.is_null for b in hit[:2])
    assert manager.get_num_blocks_to_allocate("b", 16, hit) == 1 + 1
    manager.free("a")
    pool.check_consistency()
    assert manager.find_longest_cache_hit(request("c", 3).block_hashes, 3) == []


@pytest.mark.parametrize("group_id, error", [(-1, ValueError), ("0", TypeError),
                                             (True, TypeError), (1.0, TypeError)])
def test_group_ids_are_checked(group_id: object, error: type[Exception]) -> None:
    # -1 was an IndexError, "0" a bare TypeError from a comparison. (Past INT32_MAX is refused
    # too; the old code built a map per id up to it, so that case is the pool's test.)
    spec = FullAttentionSpec(block_size=BS, **ATTN)
    with pytest.raises(error, match=r"FullAttentionManager: kv_cache_group_id: expected an int"):
        FullAttentionManager(spec, BlockPool(8), kv_cache_group_id=group_id)  # type: ignore[arg-type]


def test_a_large_group_id_costs_no_memory() -> None:
    # 5_000_000 built five million maps in the pool (hundreds of MB).
    import tracemalloc

    spec = FullAttentionSpec(block_size=BS, **ATTN)
    pool = BlockPool(8)
    tracemalloc.start()
    try:
        manager = FullAttentionManager(spec, pool, kv_cache_group_id=1_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    req = request("a", 8)
    fill(manager, req)
    assert manager.find_longest_cache_hit(req.block_hashes, 8) == manager.get_blocks("a")


def test_a_manager_needs_a_spec_and_a_pool() -> None:
    spec = FullAttentionSpec(block_size=BS, **ATTN)
    with pytest.raises(TypeError, match="block_pool must be a BlockPool, got int"):
        FullAttentionManager(spec, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kv_cache_spec must be a KVCacheSpec, got str"):
        FullAttentionManager("full", BlockPool(8))  # type: ignore[arg-type]
