"""Every KV-cache test runs in a fresh container (a CPU platform), so registrations never leak;
``assert_refs_match_tables`` checks a manager's pool against its block tables."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from app.containers import Application, create_container, use_container
from app.kvcache import KVCacheManager
from app.platforms import CpuPlatform


@pytest.fixture(autouse=True)
def kv_container() -> Iterator[Application]:
    """A fresh container on a CPU platform, active for the test."""
    container = create_container(platform=CpuPlatform())
    with use_container(container):
        yield container


def assert_refs_match_tables(manager: KVCacheManager) -> None:
    """Every block's ref count is the number of tables holding it; the pool is consistent."""
    pool = manager.block_pool
    pool.check_consistency()
    refs: Counter[int] = Counter()
    for single in manager.managers:
        for table in single.req_to_blocks.values():
            refs.update(block.block_id for block in table if not block.is_null)
    assert {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt} == dict(refs)
