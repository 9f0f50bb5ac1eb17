"""KV-cache blocks and the O(1) doubly linked free queue they wait in (``app.kvcache.block_pool``
holds the pool that owns them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from app._validation import is_int

__all__ = ["BlockHash", "FreeKVCacheBlockQueue", "KVCacheBlock"]

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
        """Take the ``n`` front blocks, front first (``ValueError`` when there are fewer)."""
        if not is_int(n):
            raise TypeError(f"popleft_n: expected an int, got {n!r} ({type(n).__name__})")
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
