"""BlockPool: null block, O(1) free queues, LRU order, ref counts, prefix cache, reset."""

from __future__ import annotations

import pytest

from app.kvcache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_null_block_is_block_zero_and_never_allocated() -> None:
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.get_usage() == 1.0
    pool.free_blocks([pool.null_block])  # skipped
    pool.check_consistency()


def test_pool_size_validation() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
    with pytest.raises(TypeError):
        BlockPool(3.0)  # type: ignore[arg-type]


def test_allocating_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="only 3 free"):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3
    assert pool.get_new_blocks(0) == []
    pool.check_consistency()


def test_free_order_is_least_recently_freed_first() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    pool.free_blocks(b)
    pool.free_blocks(a)
    # 5 was never used and comes first, then 3, 4 (freed first), then 1, 2.
    assert ids(pool.get_new_blocks(5)) == [5, 3, 4, 1, 2]


def test_ref_counts_and_double_free() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    pool.cache_full_blocks([block], [b"h"], 0, 1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])
    pool.check_consistency()


def test_cached_free_blocks_are_evictable_and_reused_last() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert pool.num_cached_blocks == 2
    pool.free_blocks(reversed(blocks))  # tail first: 4, 3 fresh; 2, 1 evictable (2 first)
    assert pool.get_cached_block(b"a") is blocks[0]
    new = pool.get_new_blocks(3)
    assert ids(new) == [4, 3, 2]  # fresh first, then evicts the least recently freed cached
    assert pool.get_cached_block(b"b") is None and blocks[1].block_hash is None
    assert pool.get_cached_block(b"a") is blocks[0]
    pool.check_consistency()


def test_touch_takes_a_hit_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"a", b"b", b"c"], 0, 3)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 3
    pool.touch([pool.null_block, blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.num_free_blocks == 2
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    pool.check_consistency()


def test_touch_of_a_free_uncached_block_is_an_error() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.touch([pool.blocks[1]])


def test_first_cached_block_wins_for_a_hash() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    with pytest.raises(ValueError, match="past"):
        pool.cache_full_blocks([a], [b"x"], 0, 2)


def test_groups_have_separate_caches() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1, group_id=0)
    pool.cache_full_blocks([b], [b"h"], 0, 1, group_id=1)
    assert pool.get_cached_block(b"h", 0) is a and pool.get_cached_block(b"h", 1) is b
    assert pool.get_cached_block(b"h", 5) is None


def test_caching_disabled() -> None:
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert a.block_hash is None and pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_only_when_nothing_is_used() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert not pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3
    pool.check_consistency()


def test_evict_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.free_blocks([blocks[0]])
    pool.evict_blocks([1, 2, 3])
    assert pool.num_cached_blocks == 0
    assert blocks[1].ref_cnt == 1  # still in use, only uncached
    pool.check_consistency()
    with pytest.raises(ValueError):
        pool.evict_blocks([9])


def test_reserved_blocks_do_not_block_a_reset() -> None:
    pool = BlockPool(4)
    reserved = pool.reserve_blocks(1)
    assert pool.num_reserved_blocks == 1 and reserved[0].ref_cnt == 1
    assert pool.reset_prefix_cache()


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5 and ids(list(queue)) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert ids(list(queue)) == [0, 1, 3, 4]
    with pytest.raises(ValueError):
        queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    assert ids(queue.popleft_n(2)) == [1, 3]
    queue.append(blocks[0])
    assert ids(list(queue)) == [4, 0]
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert queue.popleft_n(0) == []
    queue.popleft_n(2)
    with pytest.raises(ValueError):
        queue.popleft()
    assert "ref_cnt=0" in repr(blocks[0])


# -- refused calls change nothing (found by a fuzzing pass) -------------------------------------


def _snapshot(pool: BlockPool) -> list[tuple[int, bytes | None]]:
    return [(b.ref_cnt, b.block_hash) for b in pool.blocks] + [
        (pool.fresh.num_free_blocks, None), (pool.evictable.num_free_blocks, None)]


def test_a_refused_free_frees_nothing() -> None:
    # [b0, b0, b1] freed b0, then raised "double free" before b1.
    pool = BlockPool(6)
    b0, b1 = pool.get_new_blocks(2)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"double free of KVCacheBlock\(1.*given more times"):
        pool.free_blocks([b0, b0, b1])
    other = BlockPool(6).get_new_blocks(1)[0]
    with pytest.raises(ValueError, match="not a block of this pool"):
        pool.free_blocks([b1, other])
    with pytest.raises(TypeError, match="expected KVCacheBlock items"):
        pool.free_blocks([b1, 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="iterable of KVCacheBlock"):
        pool.free_blocks(5)  # type: ignore[arg-type]
    assert _snapshot(pool) == before
    assert all(b.prev_free is None and b.next_free is None for b in (b0, b1))
    pool.check_consistency()
    pool.touch([b0])
    pool.free_blocks([b0, b0, b1])  # held twice: two references dropped
    assert pool.num_free_blocks == 5
    pool.check_consistency()


def test_a_refused_eviction_evicts_nothing() -> None:
    # [1, 99] evicted block 1, then raised for 99.
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h1", b"h2"], 0, 2)
    before = _snapshot(pool)
    for ids, error in [([1, 99], ValueError), ([1, -1], ValueError), ([1, "1"], TypeError),
                       ([1, True], TypeError), ([1, 2.0], TypeError), (7, TypeError)]:
        with pytest.raises(error, match="evict_blocks"):
            pool.evict_blocks(ids)  # type: ignore[arg-type]
        assert _snapshot(pool) == before
    pool.check_consistency()


def test_refused_touch_and_cache_change_nothing() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"a", b"b", b"c"], 0, 1)
    pool.free_blocks([blocks[0], blocks[2]])  # block 1 evictable cached, block 3 fresh
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="free and not cached"):
        pool.touch([blocks[0], blocks[2]])
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_full_blocks(blocks, [b"a", b"b", b"c"], 1, 3)
    with pytest.raises(TypeError, match="block hashes must be bytes"):
        pool.cache_full_blocks(blocks, [b"a", ["b"], b"c"], 1, 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a block of this pool"):
        pool.touch([BlockPool(6).get_new_blocks(1)[0]])
    assert _snapshot(pool) == before
    pool.check_consistency()


@pytest.mark.parametrize("count, error", [(1.5, TypeError), (True, TypeError), ("2", TypeError),
                                          (-1, ValueError)])
def test_block_counts_must_be_ints(count: object, error: type[Exception]) -> None:
    # get_new_blocks(True) allocated a block; 1.5 failed inside list multiplication.
    pool = BlockPool(6)
    with pytest.raises(error, match="get_new_blocks: num_blocks: expected an int >= 0"):
        pool.get_new_blocks(count)  # type: ignore[arg-type]
    with pytest.raises(error):
        pool.reserve_blocks(count)  # type: ignore[arg-type]
    assert pool.num_free_blocks == 5 and pool.num_reserved_blocks == 0
    if error is TypeError:
        with pytest.raises(TypeError, match="popleft_n: expected an int"):
            FreeKVCacheBlockQueue().popleft_n(count)  # type: ignore[arg-type]


@pytest.mark.parametrize("group_id, error", [(-1, ValueError), ("0", TypeError),
                                             (True, TypeError), (2**31, ValueError)])
def test_group_ids_are_checked(group_id: object, error: type[Exception]) -> None:
    # get_cached_block(h, group_id=-1) answered from the last group's map.
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h"], 0, 1)
    with pytest.raises(error, match=r"group_id: expected an int in \[0, 2147483647\]"):
        pool.get_cached_block(b"h", group_id)  # type: ignore[arg-type]
    with pytest.raises(error, match="group_id"):
        pool.cache_full_blocks([block], [b"h"], 0, 1, group_id=group_id)  # type: ignore[arg-type]
    with pytest.raises(error, match="group_id"):
        pool.cached_map(group_id)  # type: ignore[arg-type]
    assert pool.get_cached_block(b"h", 0) is block and pool.num_cached_blocks == 1


def test_a_large_group_id_builds_one_map() -> None:
    # Group 5_000_000 built five million empty maps (hundreds of MB).
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h"], 0, 1, group_id=1_000_000)
    assert pool.get_cached_block(b"h", 1_000_000) is block
    assert pool.get_cached_block(b"h", 999_999) is None
    assert len(pool._cached) == 1
    pool.free_blocks([block])
    pool.check_consistency()
    assert pool.get_new_blocks(3)  # evicts it from its group's map
    assert pool.num_cached_blocks == 0
