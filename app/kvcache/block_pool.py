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

Every public ``BlockPool`` method is thread-safe: it runs under the pool's re-entrant ``lock``,
which the ``KVCacheManager`` over the pool shares (hold it to make several calls atomic). A
refused call (``TypeError`` / ``ValueError``) leaves the pool as it was: the whole argument is
checked first, or what the call did before the bad entry is undone under the lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from app._cpu import available_host_bytes
from app._validation import INT32_MAX, check_int, is_int
from app.kvcache.blocks import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

__all__ = ["BLOCK_HOST_BYTES", "BlockHash", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]

#: Host memory one block's bookkeeping takes (a ``KVCacheBlock`` and its list slot; measured
#: ~136 B with tracemalloc, rounded up).
BLOCK_HOST_BYTES = 160

class BlockPool:
    """``num_blocks`` blocks (block 0 is the null block) with prefix caching when enabled.

    Allocation (``get_new_blocks``), freeing (``free_blocks``) and cache hits (``touch``) are
    O(1) per block. ``num_free_blocks + num_used_blocks + 1 == num_blocks`` always holds. Every
    public method holds ``lock`` (re-entrant), so threads may share a pool.
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
        #: One hash -> block map per KV-cache group id (made on first use).
        self._cached: dict[int, dict[BlockHash, KVCacheBlock]] = {}
        #: Blocks held for the pool's lifetime by managers (sink tokens), not by requests.
        self.num_reserved_blocks = 0
        #: Held by every public method; the ``KVCacheManager`` over this pool shares it.
        self.lock = threading.RLock()
        #: Heads of the chains ``free_blocks`` builds before splicing them into the queues.
        self._scratch = (KVCacheBlock(-1), KVCacheBlock(-1))

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (fresh plus evictable cached)."""
        with self.lock:
            return self.fresh.num_free_blocks + self.evictable.num_free_blocks

    def get_num_free_blocks(self) -> int:
        """Same as ``num_free_blocks``."""
        return self.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one owner (the null block not counted)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, in use or evictable."""
        with self.lock:
            return sum(len(m) for m in self._cached.values())

    def get_usage(self) -> float:
        """The fraction of allocatable blocks in use, 0.0 to 1.0."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def cached_map(self, group_id: int) -> dict[BlockHash, KVCacheBlock]:
        """Group ``group_id``'s hash -> block map (read it, under ``lock``; do not change it)."""
        _check_group("cached_map", group_id)
        with self.lock:
            return self._cached.setdefault(group_id, {})

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """The block cached under ``block_hash`` in group ``group_id``, or None."""
        _check_group("get_cached_block", group_id)
        if not isinstance(block_hash, bytes):
            raise TypeError(f"get_cached_block: block_hash must be bytes, got "
                            f"{type(block_hash).__name__}")
        with self.lock:
            cached = self._cached.get(group_id)
            return None if cached is None else cached.get(block_hash)

    # -- allocation and freeing -----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref count 1), fresh ones first, then evicting.

        ``ValueError`` when fewer are free; nothing changes then.
        """
        if type(num_blocks) is not int or num_blocks < 0:  # the fast check first
            check_int("get_new_blocks: num_blocks", num_blocks, 0)
        with self.lock:
            fresh = self.fresh
            if num_blocks > fresh.num_free_blocks + self.evictable.num_free_blocks:
                raise ValueError(f"cannot allocate {num_blocks} blocks: only "
                                 f"{self.num_free_blocks} free")
            if num_blocks == 0:
                return []
            n_fresh = min(num_blocks, fresh.num_free_blocks)
            out = self._take_fresh(n_fresh, num_blocks)
            if n_fresh < num_blocks:
                out[n_fresh:] = self._take_evictable(num_blocks - n_fresh)
            return out

    def _take_fresh(self, n_fresh: int, num_blocks: int) -> list[KVCacheBlock]:
        """The ``n_fresh`` front fresh blocks (ref count 1) in a list of ``num_blocks``
        entries (the rest are filled by the caller)."""
        fresh = self.fresh
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
        return out

    def _take_evictable(self, n: int) -> list[KVCacheBlock]:
        """Evict the ``n`` least recently freed cached blocks; ref count 1, uncached."""
        cached = self._cached
        taken = self.evictable.popleft_n(n)
        for evicted in taken:
            block_hash = evicted.block_hash
            if block_hash is not None:
                del cached[evicted.hash_group][block_hash]
                evicted.block_hash = None
                evicted.hash_group = -1
            evicted.ref_cnt = 1
        return taken

    def reserve_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks for the pool's lifetime (e.g. static sink tokens); never freed."""
        with self.lock:
            blocks = self.get_new_blocks(num_blocks)
            self.num_reserved_blocks += len(blocks)
            return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks that reach 0 become free.

        Give the blocks in eviction order (first evicted first): a request frees its blocks
        tail first. The null block is skipped. ``ValueError`` (nothing freed) when a block is
        already free, given more times than it is held, or not this pool's.
        """
        blocks = _block_list("free_blocks", ordered_blocks)
        with self.lock:
            self._free(blocks)

    def _free(self, blocks: Sequence[KVCacheBlock]) -> None:
        # One pass: blocks reaching 0 are chained behind two scratch heads, spliced into the
        # free queues only when every entry was good; a bad entry undoes the pass.
        owned, null = self.blocks, self.null_block
        fresh_head, evict_head = self._scratch
        fresh_last, evict_last = fresh_head, evict_head
        n_fresh = n_evict = 0
        bad: list[object] = []
        for block in blocks:
            try:  # _is_owned, inlined: this loop runs once per freed block
                ours = owned[block.block_id] is block
            except (AttributeError, TypeError, IndexError):
                ours = False
            if ours:
                ref = block.ref_cnt
                if ref > 1:
                    block.ref_cnt = ref - 1
                    continue
                if ref == 1:
                    block.ref_cnt = 0
                    if block.block_hash is None:
                        fresh_last.next_free = block
                        block.prev_free = fresh_last
                        fresh_last = block
                        n_fresh += 1
                    else:
                        evict_last.next_free = block
                        block.prev_free = evict_last
                        evict_last = block
                        n_evict += 1
                    continue
                if block is null:
                    continue
            bad.append(block)
        if bad:
            self._undo_free(blocks, bad, (fresh_head, fresh_last), (evict_head, evict_last))
        if n_fresh:
            self._splice(self.fresh, fresh_head, fresh_last, n_fresh)
        if n_evict:
            self._splice(self.evictable, evict_head, evict_last, n_evict)

    @staticmethod
    def _splice(queue: FreeKVCacheBlockQueue, head: KVCacheBlock, last: KVCacheBlock,
                count: int) -> None:
        """Move the chain ``head.next_free .. last`` (``count`` > 0 blocks) to ``queue``'s back."""
        first: KVCacheBlock = head.next_free  # type: ignore[assignment]
        tail = queue.tail
        before: KVCacheBlock = tail.prev_free  # type: ignore[assignment]
        before.next_free = first
        first.prev_free = before
        last.next_free = tail
        tail.prev_free = last
        queue.num_free_blocks += count
        head.next_free = None

    def _undo_free(self, blocks: Sequence[KVCacheBlock], bad: list[object],
                   *chains: tuple[KVCacheBlock, KVCacheBlock]) -> None:
        """Give back every reference ``_free`` dropped, unchain what it chained, and raise
        the error of the first bad entry."""
        owned = self.blocks
        null = self.null_block
        dropped = Counter(id(b) for b in blocks if _is_owned(owned, b) and b is not null)
        dropped.subtract(id(b) for b in bad)
        for block in blocks:
            if dropped.get(id(block), 0) > 0:
                block.ref_cnt += dropped.pop(id(block))
        for head, last in chains:
            node: KVCacheBlock | None = head.next_free
            while node is not None:
                following = node.next_free if node is not last else None
                node.prev_free = node.next_free = None
                node = following
            head.next_free = None
        first = bad[0]
        held = isinstance(first, KVCacheBlock) and first.ref_cnt
        raise _entry_error("free_blocks", first, _is_owned(owned, first),
                           f"double free of {first!r}"
                           + (": given more times than it is held" if held else ""))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix-cache hit); free ones leave the queue.

        ``ValueError`` (nothing touched) for a block that is free and not cached, or not this
        pool's.
        """
        blocks = _block_list("touch", blocks)
        null = self.null_block
        with self.lock:
            for block in blocks:
                if block is null:
                    continue
                self._check_owned("touch", block)
                if block.ref_cnt == 0 and block.block_hash is None:
                    raise ValueError(f"touch: {block!r} is free and not cached")
            evictable = self.evictable
            for block in blocks:
                if block is null:
                    continue
                if block.ref_cnt == 0:
                    evictable.remove(block)
                block.ref_cnt += 1

    def _check_owned(self, what: str, block: object) -> None:
        """``TypeError`` unless ``block`` is a ``KVCacheBlock``, ``ValueError`` unless it is
        one of this pool's."""
        if not isinstance(block, KVCacheBlock):
            raise TypeError(f"{what}: expected KVCacheBlock items, got {block!r} "
                            f"({type(block).__name__})")
        block_id = block.block_id
        if not 0 <= block_id < self.num_blocks or self.blocks[block_id] is not block:
            raise ValueError(f"{what}: {block!r} is not a block of this pool")

    # -- prefix cache ---------------------------------------------------------------------

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash], start: int, end: int,
                          group_id: int = 0) -> None:
        """Cache ``blocks[start:end]`` (full, in use) under ``block_hashes[start:end]``.

        Null blocks and blocks already cached are skipped, and so is a block whose hash is
        already cached by another block (the first one wins). A bad block or hash caches
        none of them (``TypeError`` / ``ValueError``).
        """
        if not (type(start) is int and type(end) is int and type(group_id) is int
                and start >= 0 and end >= 0 and 0 <= group_id <= INT32_MAX):
            check_int("cache_full_blocks: start", start, 0)
            check_int("cache_full_blocks: end", end, 0)
            _check_group("cache_full_blocks", group_id)
        if not self.enable_caching or start >= end:
            return
        if end > len(block_hashes) or end > len(blocks):
            raise ValueError(f"cache_full_blocks: end {end} is past the {len(blocks)} blocks "
                             f"or {len(block_hashes)} hashes")
        with self.lock:
            self._cache_range(blocks, block_hashes, start, end, group_id)

    def _cache_range(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                     start: int, end: int, group_id: int) -> None:
        cached = self._cached.setdefault(group_id, {})
        owned, null = self.blocks, self.null_block
        added: list[KVCacheBlock] = []
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            try:  # _is_owned, inlined: this loop runs once per cached block
                ours = owned[block.block_id] is block
            except (AttributeError, TypeError, IndexError):
                ours = False
            if ours and (block.block_hash is not None or block is null):
                continue
            try:
                if not ours or block.ref_cnt <= 0:
                    raise _entry_error("cache_full_blocks", block, ours,
                                       f"{block!r} is not in use")
                if block_hash in cached:
                    continue
            except (TypeError, ValueError) as exc:  # a bad block, an unhashable hash
                for done in added:  # what this call cached goes back out
                    del cached[done.block_hash]  # type: ignore[arg-type]
                    done.block_hash = None
                    done.hash_group = -1
                if isinstance(exc, TypeError) and ours:
                    raise TypeError(f"cache_full_blocks: block hashes must be bytes, got "
                                    f"{type(block_hash).__name__}") from None
                raise
            cached[block_hash] = block
            block.block_hash = block_hash
            block.hash_group = group_id
            added.append(block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (free ones become fresh free blocks).

        Every id is checked (an int in ``[0, num_blocks)``) before any block is evicted.
        """
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
            raise TypeError(f"evict_blocks: expected an iterable of block ids (ints), got "
                            f"{type(block_ids).__name__}")
        ids = list(block_ids)
        for block_id in ids:
            check_int(f"evict_blocks: block id (a pool of {self.num_blocks})", block_id, 0,
                      self.num_blocks - 1)
        with self.lock:
            for block_id in ids:
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
        with self.lock:
            if self.num_used_blocks > self.num_reserved_blocks:
                return False
            moved = self.evictable.popleft_n(self.evictable.num_free_blocks)
            for block in moved:
                block.block_hash = None
                block.hash_group = -1
            self.fresh.append_n(moved)
            for cached in self._cached.values():
                cached.clear()
            return True

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent (tests, debugging).

        Free blocks have ref count 0 and sit in the right queue; used blocks have ref count > 0;
        every cached block is in its group's map; the counts add up.
        """
        with self.lock:
            seen = self._check_free_queues()
            for block in self.blocks[1:]:
                if block.block_id not in seen:
                    _require(block.ref_cnt > 0, f"{block!r} is neither free nor in use")
                if block.block_hash is not None:
                    cached = self._cached.get(block.hash_group, {})
                    _require(cached.get(block.block_hash) is block,
                             f"{block!r} is not in its group's cache map")
            for group_id, cached_map in self._cached.items():
                for block in cached_map.values():
                    _require(block.block_hash is not None and block.hash_group == group_id,
                             f"{block!r} is in the cache map of group {group_id} by mistake")
            _require(self.num_free_blocks + self.num_used_blocks + 1 == self.num_blocks,
                     "free + used + null != total")

    def _check_free_queues(self) -> set[int]:
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
        return seen


def _check_group(what: str, group_id: object) -> int:
    """``group_id`` if it is a KV-cache group id (an int in ``[0, INT32_MAX]``), else a
    ``TypeError`` / ``ValueError`` naming ``what``."""
    return check_int(f"{what}: group_id", group_id, 0, INT32_MAX)


def _is_owned(owned: list[KVCacheBlock], block: object) -> bool:
    """Whether ``block`` is the pool's block at its id (``owned``: the pool's blocks)."""
    try:
        return owned[block.block_id] is block  # type: ignore[attr-defined]
    except (AttributeError, TypeError, IndexError):
        return False


def _entry_error(what: str, block: object, ours: bool, problem: str) -> Exception:
    """Why ``what`` refuses an entry: not a block (``TypeError``), not one of this pool's
    (``ours`` False), or else ``problem``, said of a block of the pool."""
    if not isinstance(block, KVCacheBlock):
        return TypeError(f"{what}: expected KVCacheBlock items, got {block!r} "
                         f"({type(block).__name__})")
    if not ours:
        return ValueError(f"{what}: {block!r} is not a block of this pool")
    return ValueError(f"{what}: {problem}")


def _block_list(what: str, blocks: object) -> Sequence[KVCacheBlock]:
    """``blocks`` as a sequence (a list or tuple as given); ``TypeError`` for a non-iterable."""
    if isinstance(blocks, (list, tuple)):
        return blocks
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
        raise TypeError(f"{what}: expected an iterable of KVCacheBlock, got "
                        f"{type(blocks).__name__}")
    return list(blocks)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
