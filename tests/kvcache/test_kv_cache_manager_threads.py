"""Four threads drive one KVCacheManager, each its own requests: the pool stays consistent.

Before the manager and the pool took a lock, this workload (from a fuzzing pass) corrupted the
pool within a second: blocks on two free lists, ref counts that no table explains.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from app.config import CacheConfig
from app.kvcache import (
    KVCacheManager,
    KVCacheSpecRegistry,
    MLAAttentionSpec,
    StaleCacheHitError,
)
from tests.kvcache.conftest import assert_refs_match_tables

THREADS = 4
SECONDS = 1.5


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    """Switch threads every microsecond, so that interleavings are many."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _worker(manager: KVCacheManager, t: int, deadline: float, errors: list[str]) -> None:
    rng = random.Random(t)
    i = 0
    try:
        while time.monotonic() < deadline:
            i += 1
            req = manager.new_request(f"t{t}-{i}", [rng.randrange(3)
                                                    for _ in range(rng.randrange(1, 30))])
            for _ in range(20):
                hit = manager.get_computed_blocks(req)
                try:
                    new = manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens,
                                                 hit)
                    break
                except StaleCacheHitError:  # another thread evicted the hit: look up again
                    pass
            else:
                raise AssertionError("a hit went stale 20 times in a row")
            if new is not None:
                manager.cache_blocks(req, req.num_tokens)
                req.append_token_ids(rng.randrange(3))
                if manager.allocate_slots(req, 1) is not None:
                    manager.cache_blocks(req, req.num_tokens)
            manager.free(req if rng.random() < 0.5 else req.request_id)
    except Exception as exc:  # reported by the main thread
        errors.append(f"thread {t}: {type(exc).__name__}: {exc}")


def test_threads_sharing_a_manager_keep_the_pool_consistent() -> None:
    spec = MLAAttentionSpec.from_dims(block_size=4, kv_lora_rank=16, qk_rope_head_dim=8,
                                      dtype=torch.bfloat16)
    manager = KVCacheManager.from_specs({"l0": spec}, CacheConfig(block_size=4, num_blocks=200),
                                        bindings=KVCacheSpecRegistry.bindings())
    errors: list[str] = []
    deadline = time.monotonic() + SECONDS
    threads = [threading.Thread(target=_worker, args=(manager, t, deadline, errors))
               for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert_refs_match_tables(manager)
    assert manager.num_free_blocks == 199 and manager.block_pool.num_cached_blocks > 0
