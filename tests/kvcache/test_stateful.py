"""Hypothesis state machines: allocate, cache, hit, decode, free and evict at random.

After every step: no block is owned twice (within a table, across groups, or by two requests
unless it is a shared cached block), reference counts equal owners, free + used + null = total,
and every cache hit holds exactly the tokens the request has. At the end, freeing every
request returns every block.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from app.config import CacheConfig
from app.containers import create_container, use_container
from app.kvcache import (
    CacheHit,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheRequest,
    KVCacheSpec,
    KVCacheSpecRegistry,
    SlidingWindowSpec,
)
from app.platforms import CpuPlatform

BS = 4
ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
PREFIXES = [list(range(100 * p, 100 * p + 48)) for p in range(3)]
SETTINGS = settings(max_examples=35, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class KVCacheMachine(RuleBasedStateMachine):
    """Subclasses set the layers; the pool is small so that eviction happens often."""

    SPECS: dict[str, KVCacheSpec] = {}
    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self._scope = use_container(create_container(platform=CpuPlatform()))
        self._scope.__enter__()
        self.manager = KVCacheManager.from_specs(
            self.SPECS, CacheConfig(block_size=BS, num_blocks=self.NUM_BLOCKS),
            bindings=KVCacheSpecRegistry.bindings())
        self.pool = self.manager.block_pool
        self.running: dict[str, KVCacheRequest] = {}
        #: block id -> the token prefix whose KV the block holds (full blocks only)
        self.content: dict[int, tuple[int, ...]] = {}
        self.counter = 0

    # -- helpers -----------------------------------------------------------------------------

    def _compute(self, req: KVCacheRequest) -> None:
        """The engine writes the KV of every token, then reports it."""
        tokens = list(req.token_ids)
        for manager, table in zip(self.manager.managers,
                                  self.manager.get_blocks(req.request_id), strict=True):
            size = manager.block_size
            for i, block in enumerate(table):
                if not block.is_null and (i + 1) * size <= len(tokens):
                    self.content[block.block_id] = tuple(tokens[:(i + 1) * size])
        self.manager.cache_blocks(req, req.num_tokens)

    def _forget(self, groups: tuple[list[Any], ...]) -> None:
        """Newly allocated blocks hold garbage until the engine writes them."""
        for blocks in groups:
            for block in blocks:
                self.content.pop(block.block_id, None)

    def _check_hit(self, req: KVCacheRequest, hit: CacheHit) -> None:
        tokens = list(req.token_ids)
        assert hit.num_computed_tokens <= max(req.num_tokens - 1, 0)
        for manager, blocks in zip(self.manager.managers, hit.blocks, strict=True):
            assert hit.num_computed_tokens % manager.block_size == 0
            if blocks:
                assert len(blocks) * manager.block_size == hit.num_computed_tokens
            for i, block in enumerate(blocks):
                if not block.is_null:
                    expected = tuple(tokens[:(i + 1) * manager.block_size])
                    assert self.content.get(block.block_id) == expected, "a hit with wrong KV"

    # -- rules -------------------------------------------------------------------------------

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), length=st.integers(1, 40),
          diverge=st.integers(0, 40), compute=st.booleans())
    def add_request(self, prefix: int, length: int, diverge: int, compute: bool) -> None:
        self.counter += 1
        tokens = [t if i < diverge else 10_000 + self.counter * 100 + i
                  for i, t in enumerate(PREFIXES[prefix][:length])]
        req = self.manager.new_request(f"req-{self.counter}", tokens)
        hit = self.manager.get_computed_blocks(req)
        self._check_hit(req, hit)
        free_before = self.pool.num_free_blocks
        new = self.manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens, hit)
        if new is None:
            assert self.pool.num_free_blocks == free_before
            assert not self.manager.holds(req.request_id)
            assert req.num_computed_tokens == 0
            return
        assert req.num_computed_tokens == hit.num_computed_tokens
        self._forget(new.blocks)
        self.running[req.request_id] = req
        if compute:
            self._compute(req)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode(self, data: st.DataObject, steps: int) -> None:
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_computed_tokens < req.num_tokens:
            # Finish the prefill (or a decode step that found no free block) first: its
            # tokens need slots before the engine can write their KV.
            new = self.manager.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
            if new is None:
                return
            self._forget(new.blocks)
            self._compute(req)
        for _ in range(steps):
            req.append_token_ids(7)
            new = self.manager.allocate_slots(req, 1)
            if new is None:
                return
            self._forget(new.blocks)
            self._compute(req)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(self.running.pop(rid))

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)
        if not self.running:
            assert self.pool.num_cached_blocks == 0

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def ownership_is_consistent(self) -> None:
        owners: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        for rid in self.running:
            for group, table in enumerate(self.manager.get_blocks(rid)):
                real = [b.block_id for b in table if not b.is_null]
                assert len(real) == len(set(real)), "a block twice in one table"
                for block_id in real:
                    assert group_of.setdefault(block_id, group) == group, "a block in two groups"
                owners.update(real)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == owners[block.block_id], f"{block!r} vs {owners[block.block_id]}"
            if owners[block.block_id] > 1:
                assert block.block_hash is not None, "an uncached block shared by two requests"
        used = sum(1 for count in owners.values() if count > 0)
        assert self.pool.num_free_blocks + used + 1 == self.NUM_BLOCKS
        assert self.pool.num_used_blocks == used
        self.pool.check_consistency()

    @invariant()
    def windows_keep_their_blocks(self) -> None:
        for manager in self.manager.managers:
            window = getattr(manager, "sliding_window", None)
            if window is None:
                continue
            for rid, req in self.running.items():
                table = manager.get_blocks(rid)
                first = max(0, req.num_computed_tokens - window + 1) // manager.block_size
                assert all(not b.is_null for b in table[first:]), "a block in the window freed"

    def teardown(self) -> None:
        try:
            for req in list(self.running.values()):
                self.manager.free(req)
            self.running.clear()
            assert self.pool.num_free_blocks == self.NUM_BLOCKS - 1, "blocks leaked"
            assert all(block.ref_cnt == 0 for block in self.pool.blocks)
            self.pool.check_consistency()
        finally:
            self._scope.__exit__(None, None, None)


class FullAttentionMachine(KVCacheMachine):
    SPECS = {f"layer.{i}": FullAttentionSpec(block_size=BS, **ATTN) for i in range(2)}


class HybridMachine(KVCacheMachine):
    SPECS = {"full": FullAttentionSpec(block_size=BS, **ATTN),
             "swa": SlidingWindowSpec(block_size=BS, sliding_window=8, **ATTN)}
    NUM_BLOCKS = 32


TestFullAttention = FullAttentionMachine.TestCase
TestFullAttention.settings = SETTINGS
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = SETTINGS
