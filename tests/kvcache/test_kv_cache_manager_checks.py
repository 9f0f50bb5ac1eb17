"""KVCacheManager refuses what would corrupt its pool (found by a fuzzing pass): stale or foreign
cache hits, a request id shared by two request objects, progress reported past the slots, and
arguments of the wrong type. Every refusal leaves the pool, the tables and the request as they
were."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.config import CacheConfig
from app.kvcache import (
    CacheHit,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheRequest,
    KVCacheSpecRegistry,
    MLAAttentionSpec,
    StaleCacheHitError,
)
from tests.kvcache.conftest import assert_refs_match_tables

BS = 4


def _manager(num_blocks: int = 16) -> KVCacheManager:
    spec = MLAAttentionSpec.from_dims(block_size=BS, kv_lora_rank=16, qk_rope_head_dim=8,
                                      dtype=torch.bfloat16)
    return KVCacheManager.from_specs({"l0": spec}, CacheConfig(
        block_size=BS, num_blocks=num_blocks), bindings=KVCacheSpecRegistry.bindings())


def _run(manager: KVCacheManager, request_id: str, tokens: list[int]) -> KVCacheRequest:
    """Schedule a request, write its KV (cache_blocks) and keep it running."""
    req = manager.new_request(request_id, tokens)
    hit = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens, hit)
    manager.cache_blocks(req, req.num_tokens)
    return req


def _state(manager: KVCacheManager, *requests: KVCacheRequest) -> Any:
    pool = manager.block_pool
    return ([(b.ref_cnt, b.block_hash) for b in pool.blocks], pool.num_free_blocks,
            [(r.num_computed_tokens, manager.get_block_ids(r.request_id)) for r in requests])


# -- cache hits ---------------------------------------------------------------------------------


def test_a_hit_whose_block_was_evicted_is_refused_and_nothing_leaks() -> None:
    # The hit's tail block was evicted (and freed uncached) before it was attached: touch
    # failed half-way, leaving the head block with ref count 1 and no table holding it.
    manager = _manager(num_blocks=5)
    manager.free(_run(manager, "a", list(range(9))))
    b = manager.new_request("b", list(range(9)))
    hit = manager.get_computed_blocks(b)
    assert hit.get_block_ids() == ([1, 2],)
    manager.free(_run(manager, "c", [100 + i for i in range(11)]))  # evicts block 2
    before = _state(manager, b)
    with pytest.raises(StaleCacheHitError, match=r"stale: block 2 .* was evicted"):
        manager.allocate_slots(b, b.num_tokens - hit.num_computed_tokens, hit)
    assert _state(manager, b) == before and not manager.holds("b")
    assert_refs_match_tables(manager)


def test_a_hit_whose_blocks_hold_other_tokens_now_is_refused() -> None:
    # Evicted and cached again with another request's tokens: it was attached silently.
    manager = _manager(num_blocks=5)
    manager.free(_run(manager, "a", list(range(9))))
    b = manager.new_request("b", list(range(9)))
    hit = manager.get_computed_blocks(b)
    manager.free(_run(manager, "c", [100 + i for i in range(16)]))  # re-caches blocks 1..4
    before = _state(manager, b)
    with pytest.raises(StaleCacheHitError, match="caches tokens other than those of request 'b'"):
        manager.allocate_slots(b, b.num_tokens - hit.num_computed_tokens, hit)
    assert _state(manager, b) == before
    assert_refs_match_tables(manager)
    assert manager.allocate_slots(b, b.num_tokens, manager.get_computed_blocks(b)) is not None


def test_a_hit_for_another_requests_tokens_is_refused() -> None:
    manager = _manager()
    _run(manager, "a", list(range(9)))
    hit = manager.get_computed_blocks(manager.new_request("x", list(range(9))))
    y = manager.new_request("y", [50 + i for i in range(9)])
    before = _state(manager, y)
    with pytest.raises(ValueError, match="caches tokens other than"):
        manager.allocate_slots(y, 1, hit)
    assert _state(manager, y) == before
    assert_refs_match_tables(manager)


def test_a_hit_from_another_manager_is_refused() -> None:
    first, second = _manager(), _manager()
    _run(first, "a", list(range(9)))
    _run(second, "a", list(range(9)))
    hit = first.get_computed_blocks(first.new_request("b", list(range(9))))
    b = second.new_request("b", list(range(9)))
    before = (_state(first), _state(second, b))
    with pytest.raises(ValueError, match="not a block of its pool"):
        second.allocate_slots(b, 1, hit)
    assert (_state(first), _state(second, b)) == before
    assert_refs_match_tables(first)
    assert_refs_match_tables(second)


def test_forged_hits_are_refused() -> None:
    manager = _manager()
    a = _run(manager, "a", list(range(9)))
    blocks = manager.get_blocks("a")[0]
    b = manager.new_request("b", list(range(9)))
    null = manager.block_pool.null_block
    before = _state(manager, a, b)
    for hit, error, match in [
        (CacheHit(([null, blocks[1]],), 8), ValueError, "position 0"),  # no nulls in full attn
        (CacheHit((blocks[:1],), 8), ValueError, "group 0 needs 2 blocks"),
        (CacheHit((blocks[:2],), 9), ValueError, "multiples of 4"),
        (CacheHit((blocks[:2], []), 8), ValueError, "from another manager"),
        (CacheHit(([], ), 8), ValueError, "needs 2 blocks"),
        (CacheHit(([blocks[0], "x"],), 8), TypeError, "not a KVCacheBlock"),  # type: ignore[list-item]
        (CacheHit([blocks[:2]], 8), TypeError, "tuple"),  # type: ignore[arg-type]
        (CacheHit((blocks[:2],), -8), ValueError, "expected an int >= 0"),
        ("x", TypeError, "cache_hit must be a CacheHit"),
    ]:
        with pytest.raises(error, match=match):
            manager.allocate_slots(b, 1, hit)  # type: ignore[arg-type]
        assert _state(manager, a, b) == before
    assert_refs_match_tables(manager)


# -- request ids, free and progress --------------------------------------------------------------


def test_two_request_objects_cannot_share_a_live_id() -> None:
    manager = _manager()
    first = manager.new_request("dup", list(range(8)))
    second = manager.new_request("dup", [9] * 8)  # fine while the id holds nothing
    assert manager.allocate_slots(first, 8) is not None
    before = _state(manager, first)
    with pytest.raises(ValueError, match="another request object with id 'dup'"):
        manager.allocate_slots(second, 8)
    with pytest.raises(ValueError, match="another request object with id 'dup'"):
        manager.cache_blocks(second, 4)
    with pytest.raises(ValueError, match="another request object with id 'dup'"):
        manager.get_computed_blocks(second)
    with pytest.raises(ValueError, match="another request object with id 'dup'"):
        manager.free(second)
    with pytest.raises(ValueError, match="'dup' is in use"):
        manager.new_request("dup", [1])
    assert _state(manager, first) == before
    manager.free(first)
    assert manager.allocate_slots(second, 8) is not None
    assert_refs_match_tables(manager)


def test_free_by_id_resets_the_request() -> None:
    # free("r") left num_computed_tokens at 8: allocated again, the fresh blocks counted as
    # computed and cache_blocks published them: a later request hit KV never written.
    manager = _manager()
    r = _run(manager, "r", list(range(8)))
    manager.free("r")
    assert r.num_computed_tokens == 0 and not manager.holds("r")
    assert manager.reset_prefix_cache()
    r.append_token_ids(8)
    assert manager.allocate_slots(r, 1) is not None
    with pytest.raises(ValueError, match="slots for 1"):
        manager.cache_blocks(r, 9)
    assert r.num_computed_tokens == 0
    x = manager.new_request("x", list(range(9)))
    assert manager.get_computed_blocks(x).num_computed_tokens == 0


def test_a_request_with_progress_but_no_blocks_is_refused() -> None:
    first, second = _manager(), _manager()
    r = _run(first, "r", list(range(8)))
    free = second.num_free_blocks
    with pytest.raises(ValueError, match="8 computed tokens but holds no blocks"):
        second.allocate_slots(r, 1)
    assert second.num_free_blocks == free and r.num_computed_tokens == 8


def test_progress_is_reported_only_for_allocated_slots() -> None:
    manager = _manager()
    r = manager.new_request("r", list(range(12)))
    with pytest.raises(ValueError, match="holds no slots"):
        manager.cache_blocks(r, 12)  # never allocated
    with pytest.raises(ValueError, match="holds no slots"):
        manager.cache_blocks(r)
    assert manager.allocate_slots(r, 4) is not None
    with pytest.raises(ValueError, match="slots for 4"):
        manager.cache_blocks(r, 12)
    assert r.num_computed_tokens == 0 and manager.block_pool.num_cached_blocks == 0
    manager.cache_blocks(r, 4)
    assert r.num_computed_tokens == 4
    assert manager.allocate_slots(r, 4, num_lookahead_tokens=2) is not None
    manager.cache_blocks(r, 10)  # drafts have slots too
    manager.free(r)
    with pytest.raises(ValueError, match="holds no slots"):
        manager.cache_blocks(r, 4)


# -- argument types ------------------------------------------------------------------------------


def _bad_calls(manager: KVCacheManager, spec: FullAttentionSpec) -> list[Any]:
    bindings = KVCacheSpecRegistry.bindings()
    r = manager.new_request("r", list(range(6)))
    return [
        (lambda: manager.free(5), "free: expected a KVCacheRequest or a request id"),  # type: ignore[arg-type]
        (lambda: manager.free(None), "got None"),  # type: ignore[arg-type]
        (lambda: manager.allocate_slots("r", 4), "allocate_slots: expected a KVCacheRequest"),  # type: ignore[arg-type]
        (lambda: manager.get_computed_blocks("r"), "get_computed_blocks: expected a"),  # type: ignore[arg-type]
        (lambda: manager.cache_blocks("r", 4), "cache_blocks: expected a KVCacheRequest"),  # type: ignore[arg-type]
        (lambda: manager.allocate_slots(r, 4, "x"), "cache_hit must be a CacheHit"),  # type: ignore[arg-type]
        (lambda: manager.get_blocks([1]), "get_blocks: expected a request id"),  # type: ignore[arg-type]
        (lambda: manager.get_block_ids(5), "get_block_ids: expected a request id"),  # type: ignore[arg-type]
        (lambda: manager.holds([1]), "holds: expected a request id"),  # type: ignore[arg-type]
        (lambda: KVCacheManager.from_specs({"l": spec}, {"num_blocks": 4},  # type: ignore[arg-type]
                                           bindings=bindings), "cache_config must be"),
        (lambda: KVCacheManager(5, bindings=bindings), "kv_cache_groups must be"),  # type: ignore[arg-type]
        (lambda: KVCacheManager(["x"], bindings=bindings), r"kv_cache_groups\[0\]"),  # type: ignore[list-item]
        (lambda: KVCacheManager.from_specs([spec], bindings=bindings),  # type: ignore[arg-type]
         "kv_cache_specs must be a mapping"),
        (lambda: KVCacheManager.from_specs({"l": spec}, enable_caching="no",  # type: ignore[arg-type]
                                           bindings=bindings), "enable_caching must be a bool"),
    ]


def test_wrong_argument_types_get_a_type_error() -> None:
    manager = _manager()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    for call, match in _bad_calls(manager, spec):
        with pytest.raises(TypeError, match=match):
            call()
    assert manager.num_free_blocks == 15 and not manager.holds("r")
