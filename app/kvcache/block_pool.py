"""The block pool: paged KV-cache blocks, their reference counts, free queues and prefix cache.

Block 0 is the *null block*: a placeholder for table entries that hold nothing (sliding-window
positions that fell out of the window, Mamba positions between checkpoints). It is never
allocated, never freed and never counted as free.

Free blocks wait in two O(1) doubly linked queues, both least recently freed first:

- ``fresh``: blocks that hold no cached content; allocation takes these first.
- ``evictable``: free blocks whose content is still in the prefix cache. Allocation takes them
  only when no fresh block is left, evicting the least recently freed first (a request's blocks
  are freed tail first, so the tail of a cached prefix goes before its head). A prefix-cache
  hit takes a block back out of this queue (``touch``).

Prefix caching keys a full block by its *block hash*, which chains the hash of the previous
block with this block's tokens, so equal hashes mean equal prefixes. Each KV-cache group has its
own hash -> block map. The first block cached under a hash wins; a later block with the same
content stays uncached (its table entry does not move, so block tables stay append-only).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from app._host import available_host_bytes
from app._validation import INT32_MAX, is_int

__all__ = ["BLOCK_HOST_BYTES", "BlockHash", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]

#: Host memory one block's bookkeeping takes (a ``KVCacheBlock`` and its list slot; measured
#: ~136 B with tracemalloc, rounded up).
BLOCK_HOST_BYTES = 160

#: A block hash: the digest of a chained prefix (see ``app.kvcache.request``).
BlockHash = bytes


class KVCacheBlock:
    """One block of the paged KV cache (metadata only; the tensors live in the engine).

    ``ref_cnt`` counts the requests (and managers) that hold the block; ``block_hash`` is set
    while the block is in the prefix cache of group ``hash_group``. ``prev_free`` and
    ``next_free`` link the block into a free queue and belong to the pool.
    """

    __slots__ = ("block_hash", "block_id", "hash_group", "is_null", "next_free", "prev_free",
                 "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id: int = block_id
        self.ref_cnt: int = 0
        self.block_hash: BlockHash | None = None
        self.hash_group: int = -1
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null: bool = False

    @property
    def is_cached(self) -> bool:
        """Whether the block is in the prefix cache."""
        return self.block_hash is not None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", cached(group {self.hash_group})"
        null = ", null" if self.is_null else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached}{null})"


class FreeKVCacheBlockQueue:
    """A doubly linked queue of free blocks: O(1) append, pop from the front and remove.

    The links live in the blocks themselves (``prev_free`` / ``next_free``), so no Python object
    is created per operation. Two sentinel blocks (id -1) bound the list.
    """

    __slots__ = ("head", "num_free_blocks", "tail")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The blocks from front (next to be taken) to back."""
        block = self.head.next_free
        tail = self.tail
        while block is not None and block is not tail:
            yield block
            block = block.next_free

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back."""
        tail = self.tail
        last: KVCacheBlock = tail.prev_free  # type: ignore[assignment]  # never None: sentinel
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in order."""
        tail = self.tail
        last: KVCacheBlock = tail.prev_free  # type: ignore[assignment]  # never None: sentinel
        count = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free_blocks += count

    def popleft(self) -> KVCacheBlock:
        """Take the front block (``ValueError`` when empty)."""
        if not self.num_free_blocks:
            raise ValueError("no free blocks in the queue")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` front blocks, front first (the caller checks there are enough)."""
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks from a queue of {self.num_free_blocks}")
        head = self.head
        block = head.next_free
        out = [block] * n
        for i in range(n):
            out[i] = block
            block = block.next_free  # type: ignore[union-attr]
        head.next_free = block
        block.prev_free = head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        for taken in out:
            taken.prev_free = taken.next_free = None  # type: ignore[union-attr]
        return out  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle of the queue in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in a free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1


class BlockPool:
    """``num_blocks`` blocks (block 0 is the null block) with prefix caching when enabled.

    Allocation (``get_new_blocks``), freeing (``free_blocks``) and cache hits (``touch``) are
    O(1) per block. ``num_free_blocks + num_used_blocks + 1 == num_blocks`` always holds.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not is_int(num_blocks):
            raise TypeError(f"BlockPool: num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks must be >= 2 (block 0 is the null block), "
                             f"got {num_blocks}")
        if num_blocks > INT32_MAX:
            raise ValueError(f"BlockPool: num_blocks must be at most {INT32_MAX} (block ids are "
                             f"int32), got {num_blocks}")
        have = available_host_bytes()
        if have is not None and num_blocks * BLOCK_HOST_BYTES > have:
            # 2**31 - 1 blocks are ~290 GB of Python objects: refused before building them.
            raise ValueError(f"BlockPool: {num_blocks} blocks need "
                             f"{num_blocks * BLOCK_HOST_BYTES / 2**30:.1f} GiB of host memory "
                             f"for their bookkeeping ({BLOCK_HOST_BYTES} B each); this host has "
                             f"{have / 2**30:.1f} GiB available: use at most "
                             f"{have // BLOCK_HOST_BYTES} blocks")
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.fresh = FreeKVCacheBlockQueue(self.blocks[1:])
        self.evictable = FreeKVCacheBlockQueue()
        #: One hash -> block map per KV-cache group.
        self._cached: list[dict[BlockHash, KVCacheBlock]] = []
        #: Blocks held for the pool's lifetime by managers (sink tokens), not by requests.
        self.num_reserved_blocks = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (fresh plus evictable cached)."""
        return self.fresh.num_free_blocks + self.evictable.num_free_blocks

    def get_num_free_blocks(self) -> int:
        """Same as ``num_free_blocks``."""
        return self.fresh.num_free_blocks + self.evictable.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one owner (the null block not counted)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, in use or evictable."""
        return sum(len(m) for m in self._cached)

    def get_usage(self) -> float:
        """The fraction of allocatable blocks in use, 0.0 to 1.0."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def cached_map(self, group_id: int) -> dict[BlockHash, KVCacheBlock]:
        """Group ``group_id``'s hash -> block map (read it, do not change it)."""
        cached = self._cached
        while len(cached) <= group_id:
            cached.append({})
        return cached[group_id]

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """The block cached under ``block_hash`` in group ``group_id``, or None."""
        if group_id >= len(self._cached):
            return None
        return self._cached[group_id].get(block_hash)

    # -- allocation and freeing -----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref count 1), fresh ones first, then evicting.

        ``ValueError`` when fewer are free; nothing changes then.
        """
        fresh = self.fresh
        if num_blocks > fresh.num_free_blocks + self.evictable.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only "
                             f"{self.num_free_blocks} free")
        if num_blocks <= 0:
            return []
        n_fresh = min(num_blocks, fresh.num_free_blocks)
        head = fresh.head
        block = head.next_free
        out: list[KVCacheBlock] = [block] * num_blocks  # type: ignore[list-item]
        for i in range(n_fresh):
            out[i] = block  # type: ignore[assignment]
            block.ref_cnt = 1  # type: ignore[union-attr]
            block.prev_free = None  # type: ignore[union-attr]
            block = block.next_free  # type: ignore[union-attr]
        if n_fresh:
            out[n_fresh - 1].next_free = None
            head.next_free = block
            block.prev_free = head  # type: ignore[union-attr]
            fresh.num_free_blocks -= n_fresh
        if n_fresh < num_blocks:
            cached = self._cached
            for i, evicted in enumerate(self.evictable.popleft_n(num_blocks - n_fresh),
                                        start=n_fresh):
                block_hash = evicted.block_hash
                if block_hash is not None:
                    del cached[evicted.hash_group][block_hash]
                    evicted.block_hash = None
                    evicted.hash_group = -1
                evicted.ref_cnt = 1
                out[i] = evicted
        return out

    def reserve_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks for the pool's lifetime (e.g. static sink tokens); never freed."""
        blocks = self.get_new_blocks(num_blocks)
        self.num_reserved_blocks += len(blocks)
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks that reach 0 become free.

        Give the blocks in eviction order (first evicted first): a request frees its blocks
        tail first. The null block is skipped. ``ValueError`` on a block that is already free.
        """
        fresh_tail = self.fresh.tail
        evict_tail = self.evictable.tail
        fresh_last = fresh_tail.prev_free
        evict_last = evict_tail.prev_free
        n_fresh = n_evict = 0
        try:
            for block in ordered_blocks:
                ref = block.ref_cnt - 1
                block.ref_cnt = ref
                if ref:
                    if ref < 0:
                        block.ref_cnt = 0
                        if block.is_null:
                            continue
                        raise ValueError(f"double free of {block!r}")
                    continue
                if block.block_hash is None:
                    fresh_last.next_free = block  # type: ignore[union-attr]
                    block.prev_free = fresh_last
                    fresh_last = block
                    n_fresh += 1
                else:
                    evict_last.next_free = block  # type: ignore[union-attr]
                    block.prev_free = evict_last
                    evict_last = block
                    n_evict += 1
        finally:
            fresh_last.next_free = fresh_tail  # type: ignore[union-attr]
            fresh_tail.prev_free = fresh_last
            self.fresh.num_free_blocks += n_fresh
            evict_last.next_free = evict_tail  # type: ignore[union-attr]
            evict_tail.prev_free = evict_last
            self.evictable.num_free_blocks += n_evict

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix-cache hit); free ones leave the queue."""
        evictable = self.evictable
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    raise ValueError(f"touch: {block!r} is free and not cached")
                evictable.remove(block)
            block.ref_cnt += 1

    # -- prefix cache ---------------------------------------------------------------------

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash], start: int, end: int,
                          group_id: int = 0) -> None:
        """Cache ``blocks[start:end]`` (full, in use) under ``block_hashes[start:end]``.

        Null blocks and blocks already cached are skipped, and so is a block whose hash is
        already cached by another block (the first one wins).
        """
        if not self.enable_caching or start >= end:
            return
        if end > len(block_hashes) or end > len(blocks):
            raise ValueError(f"cache_full_blocks: end {end} is past the {len(blocks)} blocks "
                             f"or {len(block_hashes)} hashes")
        cached = self.cached_map(group_id)
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"cache_full_blocks: {block!r} is not in use")
            block_hash = block_hashes[i]
            if block_hash in cached:
                continue
            cached[block_hash] = block
            block.block_hash = block_hash
            block.hash_group = group_id

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (free ones become fresh free blocks)."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"evict_blocks: no block {block_id} in a pool of "
                                 f"{self.num_blocks}")
            block = self.blocks[block_id]
            block_hash = block.block_hash
            if block_hash is None:
                continue
            del self._cached[block.hash_group][block_hash]
            block.block_hash = None
            block.hash_group = -1
            if block.ref_cnt == 0:
                self.evictable.remove(block)
                self.fresh.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only when no block is in use (returns whether it did).

        Reserved blocks (``reserve_blocks``) do not count as in use here.
        """
        if self.num_used_blocks > self.num_reserved_blocks:
            return False
        moved = self.evictable.popleft_n(self.evictable.num_free_blocks)
        for block in moved:
            block.block_hash = None
            block.hash_group = -1
        self.fresh.append_n(moved)
        for cached in self._cached:
            cached.clear()
        return True

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent (tests, debugging).

        Free blocks have ref count 0 and sit in the right queue; used blocks have ref count > 0;
        every cached block is in its group's map; the counts add up.
        """
        seen: set[int] = set()
        for queue, cached in ((self.fresh, False), (self.evictable, True)):
            count = 0
            for block in queue:
                _require(block.block_id not in seen, f"{block!r} is in a free queue twice")
                seen.add(block.block_id)
                _require(block.ref_cnt == 0, f"free {block!r} has ref count {block.ref_cnt}")
                _require(not block.is_null, "the null block is in a free queue")
                _require((block.block_hash is not None) == cached,
                         f"{block!r} is in the wrong free queue")
                count += 1
            _require(count == queue.num_free_blocks, "a free queue's count is out of sync")
        for block in self.blocks[1:]:
            if block.block_id not in seen:
                _require(block.ref_cnt > 0, f"{block!r} is neither free nor in use")
            if block.block_hash is not None:
                _require(self._cached[block.hash_group].get(block.block_hash) is block,
                         f"{block!r} is not in its group's cache map")
        for group_id, cached_map in enumerate(self._cached):
            for block in cached_map.values():
                _require(block.block_hash is not None and block.hash_group == group_id,
                         f"{block!r} is in the cache map of group {group_id} by mistake")
        _require(self.num_free_blocks + self.num_used_blocks + 1 == self.num_blocks,
                 "free + used + null != total")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
