"""Single-type KV-cache managers: one per spec family, each managing one KV-cache group.

A manager keeps each request's *block table* for its group (``req_to_blocks``), allocates and
frees blocks through the shared ``BlockPool``, publishes full blocks to the prefix cache and
finds cache hits. The registry binds spec types to these classes (``KVCacheSpecRegistry``).

The methods, in the order a scheduler step uses them (``KVCacheManager`` does this for you):

- ``find_longest_cache_hit(block_hashes, max_length)``: the cached blocks of the longest usable
  prefix (at most ``max_length`` tokens), null blocks where the layer needs nothing.
- ``remove_skipped_blocks(request_id, num_computed_tokens)``: windowed managers replace blocks
  that left the window by the null block and free them.
- ``get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks)``: how many free
  blocks an allocation would consume (cache hits that sit in the free queue count too).
- ``add_computed_blocks(request_id, blocks)``: attach a cache hit to a new request.
- ``allocate_new_blocks(request_id, num_tokens)``: grow the table to cover ``num_tokens``.
- ``cache_blocks(request, num_tokens)``: publish the full blocks of the first ``num_tokens``.
- ``free(request_id)``: release the request's blocks, tail first.

A single-type manager takes no lock of its own: ``KVCacheManager`` calls it under the pool's
``lock``. Code that drives one directly from several threads holds ``block_pool.lock``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import takewhile
from typing import TYPE_CHECKING, ClassVar

from app._validation import INT32_MAX, check_int
from app.kvcache.block_pool import BlockHash, BlockPool, KVCacheBlock
from app.kvcache.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

if TYPE_CHECKING:
    from app.kvcache.request import KVCacheRequest

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
]


class SingleTypeKVCacheManager:
    """The manager of one KV-cache group whose layers share one spec rule.

    ``SingleTypeKVCacheManager(spec, pool, kv_cache_group_id=0)``. The base class holds every
    block of a request until it is freed (full attention); subclasses change the cache-hit
    search and which blocks a request can drop.
    """

    #: Whether this group's blocks take part in prefix caching and cache hits.
    supports_prefix_caching: ClassVar[bool] = True
    #: Whether a cache hit of this group may hold null blocks (positions it needs nothing at).
    hit_may_hold_null_blocks: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *,
                 kv_cache_group_id: int = 0, enable_caching: bool | None = None) -> None:
        name = type(self).__name__
        if not isinstance(kv_cache_spec, KVCacheSpec):
            raise TypeError(f"{name}: kv_cache_spec must be a KVCacheSpec, got "
                            f"{type(kv_cache_spec).__name__}")
        if not isinstance(block_pool, BlockPool):
            raise TypeError(f"{name}: block_pool must be a BlockPool, got "
                            f"{type(block_pool).__name__}")
        check_int(f"{name}: kv_cache_group_id", kv_cache_group_id, 0, INT32_MAX)
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.block_size = kv_cache_spec.block_size
        self.kv_cache_group_id = kv_cache_group_id
        caching = block_pool.enable_caching if enable_caching is None else enable_caching
        self.enable_caching = bool(caching and block_pool.enable_caching
                                   and self.supports_prefix_caching)
        #: request id -> the request's block table for this group.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: request id -> how many leading blocks of its table are already cached.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self._cached = block_pool.cached_map(kv_cache_group_id)

    # -- sizes -----------------------------------------------------------------------------

    def num_tokens_for(self, request: KVCacheRequest, num_tokens: int) -> int:
        """The tokens this group needs slots for when the request needs ``num_tokens``."""
        return num_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to, once ``num_computed_tokens`` are computed."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = ()) -> int:
        """Free blocks consumed by giving the request ``num_tokens`` slots after attaching
        ``new_computed_blocks`` (hits still in the free queue leave it, so they count)."""
        blocks = self.req_to_blocks.get(request_id)
        num_held = (0 if blocks is None else len(blocks)) + len(new_computed_blocks)
        num_new = cdiv(num_tokens, self.block_size) - num_held
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return max(num_new, 0) + num_evictable

    # -- allocation ------------------------------------------------------------------------

    def add_computed_blocks(self, request_id: str,
                            new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Attach a prefix-cache hit to a request that holds no blocks yet (touches them)."""
        if not new_computed_blocks:
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            raise ValueError(f"add_computed_blocks: request {request_id!r} already holds "
                             f"{len(blocks)} blocks in group {self.kv_cache_group_id}")
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to ``cdiv(num_tokens, block_size)`` blocks; the new ones."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (the live list: read it, do not change it)."""
        return self.req_to_blocks.get(request_id, [])

    # -- prefix cache ----------------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the start, at most ``max_length`` tokens.

        ``block_hashes`` are at this group's block size. Hit length: ``len(result) *
        block_size`` tokens.
        """
        if not self.enable_caching:
            return []
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        # A miss ends the prefix: the chained hashes of every later block miss too.
        get: Callable[[BlockHash], KVCacheBlock] = self._cached.get  # type: ignore[assignment]
        return list(takewhile(bool, map(get, block_hashes[:num_blocks])))

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Publish the full blocks among the request's first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        block_hashes = group_block_hashes(request, self.block_size)
        num_full = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
        start = self.num_cached_block.get(request_id, 0)
        if start >= num_full:
            return
        self.block_pool.cache_full_blocks(blocks, block_hashes, start, num_full,
                                          self.kv_cache_group_id)
        self.num_cached_block[request_id] = num_full

    # -- releasing -------------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token needs, replacing them by the null block."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self._null_block
        removed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break  # everything before was removed by an earlier call
            removed.append(block)
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (a no-op for unknown requests)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA, TurboQuant, hidden states): every block until the end."""


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with static sink tokens.

    The manager reserves ``sink_len // block_size`` blocks once, when it is built; the engine
    writes the sink K/V there and puts ``sink_block_ids`` in front of every request's table.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *,
                 kv_cache_group_id: int = 0, enable_caching: bool | None = None) -> None:
        if not isinstance(kv_cache_spec, SinkFullAttentionSpec):
            raise TypeError(f"SinkFullAttentionManager needs a SinkFullAttentionSpec, "
                            f"got {type(kv_cache_spec).__name__}")
        if kv_cache_spec.sink_len % kv_cache_spec.block_size:
            raise ValueError(f"SinkFullAttentionSpec: sink_len {kv_cache_spec.sink_len} must be "
                             f"a multiple of block_size {kv_cache_spec.block_size}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id=kv_cache_group_id,
                         enable_caching=enable_caching)
        num_sink_blocks = kv_cache_spec.sink_len // kv_cache_spec.block_size
        if num_sink_blocks > block_pool.num_free_blocks:
            raise ValueError(f"SinkFullAttentionManager: the pool has "
                             f"{block_pool.num_free_blocks} free blocks, fewer than the "
                             f"{num_sink_blocks} sink blocks")
        #: The blocks holding the sink tokens (held by this manager for its lifetime).
        self.sink_blocks = block_pool.reserve_blocks(num_sink_blocks)

    @property
    def sink_block_ids(self) -> list[int]:
        """The ids of the sink blocks, in order."""
        return [block.block_id for block in self.sink_blocks]


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: blocks that left the window are freed (null in the table)."""

    hit_may_hold_null_blocks = True

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *,
                 kv_cache_group_id: int = 0, enable_caching: bool | None = None) -> None:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise TypeError(f"SlidingWindowManager needs a SlidingWindowSpec, "
                            f"got {type(kv_cache_spec).__name__}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id=kv_cache_group_id,
                         enable_caching=enable_caching)
        self.sliding_window = kv_cache_spec.sliding_window
        #: Contiguous cached blocks a hit needs: the window before the next token.
        self.num_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token: ``n - sliding_window + 1``."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> list[KVCacheBlock]:
        """The longest prefix whose last window of blocks is cached; earlier entries are null.

        Searches from the right and stops at the first run of ``num_contiguous_blocks`` cached
        blocks; without one, the cached run at the very start (if any) is the hit.
        """
        if not self.enable_caching:
            return []
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        need = self.num_contiguous_blocks
        get = self._cached.get
        null = self._null_block
        if 0 < need <= num_blocks:
            tail = list(map(get, block_hashes[num_blocks - need:num_blocks]))
            if None not in tail:  # the common full hit: one C-level pass
                return [null] * (num_blocks - need) + tail  # type: ignore[operator]
        computed = [null] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = get(block_hashes[i])
            if block is None:
                run = 0
                continue
            computed[i] = block
            run += 1
            if run >= need:
                del computed[i + run:]
                return computed
        del computed[run:]  # the run at the start (shorter than a window) is still a hit
        return computed


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: tokens attend within their chunk; earlier chunks are freed."""

    hit_may_hold_null_blocks = True

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *,
                 kv_cache_group_id: int = 0, enable_caching: bool | None = None) -> None:
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise TypeError(f"ChunkedLocalAttentionManager needs a ChunkedLocalAttentionSpec, "
                            f"got {type(kv_cache_spec).__name__}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id=kv_cache_group_id,
                         enable_caching=enable_caching)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's chunk."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> list[KVCacheBlock]:
        """Null blocks for whole blocks before the current chunk, then cached blocks."""
        if not self.enable_caching:
            return []
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        chunk_start = max_length // self.attention_chunk_size * self.attention_chunk_size
        num_null = min(chunk_start // self.block_size, num_blocks)
        computed = [self._null_block] * num_null
        get: Callable[[BlockHash], KVCacheBlock] = self._cached.get  # type: ignore[assignment]
        computed.extend(takewhile(bool, map(get, block_hashes[num_null:num_blocks])))
        return computed


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention: blocks for the encoder tokens, once per request, never cached."""

    supports_prefix_caching = False

    def num_tokens_for(self, request: KVCacheRequest, num_tokens: int) -> int:
        """Cross attention needs the encoder's tokens, whatever the decoder length."""
        return request.num_encoder_tokens

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> list[KVCacheBlock]:
        """Never a hit: encoder outputs are not shared between requests."""
        return []

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Nothing is cached."""


class MambaManager(SingleTypeKVCacheManager):
    """A Mamba (state-space) layer: one running state per request, cached at checkpoints.

    Position ``i`` of the table holds the state after ``(i + 1) * block_size`` tokens. A
    request holds a real block only at its last position (the running state) and at most
    one earlier checkpoint while a step reads it; every other position is the null block.
    The state after exactly ``k * block_size`` computed tokens is a cacheable checkpoint.
    """

    hit_may_hold_null_blocks = True

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Everything before the block holding the state after ``num_computed_tokens``."""
        if num_computed_tokens <= 0:
            return 0
        return (num_computed_tokens - 1) // self.block_size * self.block_size

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = ()) -> int:
        """One block when the table grows (the new running state), plus evictable hits."""
        blocks = self.req_to_blocks.get(request_id)
        num_held = (0 if blocks is None else len(blocks)) + len(new_computed_blocks)
        grows = cdiv(num_tokens, self.block_size) > num_held
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return int(grows) + num_evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Null blocks up to the new last position, a real block there (the running state)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        num_required = cdiv(num_tokens, self.block_size)
        if num_required <= len(blocks):
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        blocks.extend([self._null_block] * (num_required - len(blocks) - 1))
        blocks.extend(new_blocks)
        return new_blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> list[KVCacheBlock]:
        """The latest cached checkpoint within ``max_length``: nulls, then that block."""
        if not self.enable_caching:
            return []
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        get = self._cached.get
        for i in range(num_blocks - 1, -1, -1):
            block = get(block_hashes[i])
            if block is not None:
                return [self._null_block] * i + [block]
        return []

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Cache the running state when ``num_tokens`` ends exactly on a block boundary."""
        if not self.enable_caching or num_tokens <= 0 or num_tokens % self.block_size:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        index = num_tokens // self.block_size - 1
        block_hashes = group_block_hashes(request, self.block_size)
        if not blocks or index >= len(blocks) or index >= len(block_hashes):
            return
        if blocks[index].is_null or blocks[index].block_hash is not None:
            return
        self.block_pool.cache_full_blocks(blocks, block_hashes, index, index + 1,
                                          self.kv_cache_group_id)


def group_block_hashes(request: KVCacheRequest, block_size: int) -> Sequence[BlockHash]:
    """The request's block hashes at ``block_size`` (a multiple of its hash block size).

    A block of ``k`` hash blocks is keyed by the chained hash of its last hash block, which
    covers the whole prefix.
    """
    hash_block_size = request.hash_block_size
    if block_size == hash_block_size:
        return request.block_hashes
    if block_size % hash_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the request's hash "
                         f"block size {hash_block_size}")
    ratio = block_size // hash_block_size
    return request.block_hashes[ratio - 1::ratio]
