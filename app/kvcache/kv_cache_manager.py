"""``KVCacheManager``: what a scheduler calls, over every KV-cache group of a model.

One ``BlockPool`` is shared by all groups; each group has the single-type manager its spec is
bound to in the bindings it is given (the container's ``KVCacheSpecBindings``). See
``app.kvcache`` for the calling sequence.

Every public method is thread-safe: it holds the pool's re-entrant ``lock`` (shared with the
``BlockPool``), so an engine may drive its requests from several threads. A refused call
(``TypeError`` / ``ValueError``) changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from app._validation import check_int
from app.config import CacheConfig
from app.kvcache.bindings import KVCacheSpecBindings
from app.kvcache.block_pool import BlockPool, KVCacheBlock
from app.kvcache.grouping import KVCacheGroupSpec, get_kv_cache_groups
from app.kvcache.managers import SingleTypeKVCacheManager, group_block_hashes
from app.kvcache.request import KVCacheRequest
from app.kvcache.specs import KVCacheSpec

__all__ = ["CacheHit", "KVCacheBlocks", "KVCacheManager", "StaleCacheHitError"]


class StaleCacheHitError(ValueError):
    """``allocate_slots`` refused a ``CacheHit`` whose blocks were evicted, or re-cached with
    other tokens, since ``get_computed_blocks`` found it; nothing was allocated or attached.

    A ``ValueError``, so existing handlers keep working; a scheduler that looks hits up in one
    thread and attaches them in another catches just this and looks the request up again.
    """


@attrs.frozen(eq=False)
class KVCacheBlocks:
    """Blocks per KV-cache group (``blocks[g]`` for group ``g``)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The block ids per group."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks over all groups."""
        return sum(len(group) for group in self.blocks)


@attrs.frozen(eq=False)
class CacheHit:
    """A prefix-cache hit: ``num_computed_tokens`` tokens whose KV is already cached.

    ``blocks[g]`` is group ``g``'s part of the hit (null blocks where that group needs nothing).
    Pass it to ``allocate_slots`` right away: until then the blocks may be evicted (it then
    refuses the hit as stale).
    """

    blocks: tuple[list[KVCacheBlock], ...]
    num_computed_tokens: int

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The block ids per group."""
        return tuple([block.block_id for block in group] for group in self.blocks)


#: A hit's blocks per group, as ``allocate_slots`` attaches them.
_HitBlocks = tuple[Sequence[KVCacheBlock], ...]


class KVCacheManager:
    """Allocates a model's paged KV cache for requests, with prefix caching.

    ``KVCacheManager(groups, cache_config, bindings=...)`` or ``KVCacheManager.from_specs({layer:
    spec}, cache_config, bindings=...)``; ``bindings`` is the container's ``KVCacheSpecBindings``
    (``container.kv_cache_spec_bindings()``). ``cache_config.num_blocks`` sizes the pool
    (block 0 is the null block) and ``cache_config.enable_prefix_caching`` turns caching on.
    Requests must hash their tokens at ``hash_block_size`` (``new_request`` does that). A
    request id names one request object while it holds blocks. Thread-safe.
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec],
                 cache_config: CacheConfig | None = None, *, bindings: KVCacheSpecBindings,
                 num_blocks: int | None = None, enable_caching: bool | None = None) -> None:
        if not isinstance(bindings, KVCacheSpecBindings):
            raise TypeError(f"KVCacheManager: bindings must be KVCacheSpecBindings (the "
                            f"container's kv_cache_spec_bindings()), got "
                            f"{type(bindings).__name__}")
        groups = _check_groups(kv_cache_groups)
        config = _check_cache_config(cache_config)
        if enable_caching is not None and not isinstance(enable_caching, bool):
            raise TypeError(f"KVCacheManager: enable_caching must be a bool or None, got "
                            f"{enable_caching!r} ({type(enable_caching).__name__})")
        self.cache_config = config
        self.kv_cache_groups = groups
        self.enable_caching = (config.enable_prefix_caching if enable_caching is None
                               else enable_caching)
        self.block_pool = BlockPool(config.num_blocks if num_blocks is None else num_blocks,
                                    enable_caching=self.enable_caching)
        self._lock = self.block_pool.lock
        self.managers: list[SingleTypeKVCacheManager] = []
        for group_id, group in enumerate(self.kv_cache_groups):
            manager_class = bindings.get_manager_class(group.kv_cache_spec)
            if manager_class is None:
                raise ValueError(f"KVCacheManager: no manager registered for group {group_id} "
                                 f"spec {type(group.kv_cache_spec).__name__}")
            self.managers.append(manager_class(group.kv_cache_spec, self.block_pool,
                                               kv_cache_group_id=group_id))
        block_sizes = [manager.block_size for manager in self.managers]
        #: The block size requests hash at: the gcd of the groups' block sizes.
        self.hash_block_size = math.gcd(*block_sizes)
        #: Hit lengths are multiples of every group's block size.
        self._hit_alignment = math.lcm(*block_sizes)
        self._hit_managers = [m for m in self.managers if m.enable_caching]
        self._no_hit: _HitBlocks = tuple(() for _ in self.managers)
        #: request id -> (the request object holding blocks, the tokens its slots cover).
        self._live: dict[str, tuple[KVCacheRequest, int]] = {}
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found

    @classmethod
    def from_specs(cls, kv_cache_specs: Mapping[str, KVCacheSpec],
                   cache_config: CacheConfig | None = None, *, bindings: KVCacheSpecBindings,
                   num_blocks: int | None = None,
                   enable_caching: bool | None = None) -> KVCacheManager:
        """Group ``{layer_name: spec}`` (``get_kv_cache_groups``) and manage those groups."""
        _check_cache_config(cache_config)
        return cls(get_kv_cache_groups(kv_cache_specs, bindings), cache_config,
                   num_blocks=num_blocks, enable_caching=enable_caching, bindings=bindings)

    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], *,
                    cache_salt: str | bytes | None = None,
                    num_encoder_tokens: int = 0) -> KVCacheRequest:
        """A ``KVCacheRequest`` hashed at this manager's ``hash_block_size``.

        ``ValueError`` when ``request_id`` names a request that holds blocks here.
        """
        request = KVCacheRequest(request_id, prompt_token_ids,
                                 hash_block_size=self.hash_block_size, cache_salt=cache_salt,
                                 num_encoder_tokens=num_encoder_tokens)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"new_request: request id {request_id!r} is in use (that "
                                 f"request holds blocks); ids must be unique among live "
                                 f"requests: free it first")
        return request

    # -- the scheduler's calls --------------------------------------------------------------

    def _check_request(self, what: str, request: object
                       ) -> tuple[KVCacheRequest, int] | None:
        """``request``'s live entry (None: it holds no blocks). ``TypeError`` unless it is a
        ``KVCacheRequest``; ``ValueError`` for another hash block size or when another request
        object holds blocks under its id. Call it holding the lock."""
        if not isinstance(request, KVCacheRequest):
            raise TypeError(f"{what}: expected a KVCacheRequest (from new_request), got "
                            f"{request!r} ({type(request).__name__})")
        if request.hash_block_size != self.hash_block_size:
            raise ValueError(f"request {request.request_id!r} hashes blocks of "
                             f"{request.hash_block_size} tokens; this manager needs "
                             f"{self.hash_block_size} (use KVCacheManager.new_request)")
        live = self._live.get(request.request_id)
        if live is not None and live[0] is not request:
            raise ValueError(f"{what}: another request object with id {request.request_id!r} "
                             f"holds blocks in this manager; request ids must be unique among "
                             f"live requests")
        return live

    def holds(self, request_id: str) -> bool:
        """Whether the request holds blocks in any group."""
        _check_request_id("holds", request_id)
        with self._lock:
            return any(request_id in manager.req_to_blocks for manager in self.managers)

    def get_computed_blocks(self, request: KVCacheRequest) -> CacheHit:
        """The longest cached prefix of a new request, common to every group.

        At most ``num_tokens - 1`` tokens: the last token is always computed (its logits are
        needed). Empty when caching is off. Nothing is reserved: pass the hit straight to
        ``allocate_slots``.
        """
        with self._lock:
            live = self._check_request("get_computed_blocks", request)
            if not self._hit_managers or request.num_computed_tokens:
                return CacheHit(tuple([] for _ in self.managers), 0)
            if live is not None:
                raise ValueError(f"get_computed_blocks: request {request.request_id!r} already "
                                 "holds blocks; cache hits are for new requests")
            return self._find_hit(request)

    def _find_hit(self, request: KVCacheRequest) -> CacheHit:
        align = self._hit_alignment
        length = (request.num_tokens - 1) // align * align
        hits: dict[int, list[KVCacheBlock]] = {}
        while length > 0:
            shortest = length
            for manager in self._hit_managers:
                found = manager.find_longest_cache_hit(
                    group_block_hashes(request, manager.block_size), length)
                hits[manager.kv_cache_group_id] = found
                shortest = min(shortest, len(found) * manager.block_size)
            shortest = shortest // align * align
            if shortest == length or len(self._hit_managers) == 1:
                length = shortest
                break
            length = shortest  # some group hit less: search every group again up to that
        self.num_prefix_queries += request.num_tokens
        if length <= 0:
            return CacheHit(tuple([] for _ in self.managers), 0)
        self.num_prefix_hits += length
        blocks = tuple(hits.get(manager.kv_cache_group_id, [])[:length // manager.block_size]
                       if manager.enable_caching else []
                       for manager in self.managers)
        return CacheHit(blocks, length)

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int,
                       cache_hit: CacheHit | None = None, *,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens; the new blocks per group.

        Slots cover ``num_computed_tokens + hit + num_new_tokens + num_lookahead_tokens``
        tokens. A ``cache_hit`` (from ``get_computed_blocks``, for a new request) is checked,
        then attached first and advances ``request.num_computed_tokens`` by its length: a hit
        whose blocks were evicted or re-cached since (stale), or that is another manager's or
        another request's, is a ``ValueError``. Returns None, with nothing allocated or
        attached, when the pool cannot fit it. Blocks that left a sliding window (or chunk)
        are freed first.
        """
        if type(num_new_tokens) is not int or num_new_tokens < 0:  # the fast check first
            check_int("allocate_slots: num_new_tokens", num_new_tokens, 0)
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            check_int("allocate_slots: num_lookahead_tokens", num_lookahead_tokens, 0)
        if cache_hit is not None and not isinstance(cache_hit, CacheHit):
            raise TypeError(f"allocate_slots: cache_hit must be a CacheHit (from "
                            f"get_computed_blocks) or None, got {type(cache_hit).__name__}")
        with self._lock:
            live = self._check_request("allocate_slots", request)
            num_computed = request.num_computed_tokens
            if live is None and num_computed:
                raise ValueError(f"allocate_slots: request {request.request_id!r} has "
                                 f"{num_computed} computed tokens but holds no blocks in this "
                                 f"manager (another manager's request?); free it to reset it")
            hit_blocks, num_hit = self._check_hit(request, cache_hit, live)
            return self._allocate(request, num_new_tokens + num_lookahead_tokens, hit_blocks,
                                  num_hit, live)

    def _allocate(self, request: KVCacheRequest, num_new_tokens: int, hit_blocks: _HitBlocks,
                  num_hit: int, live: tuple[KVCacheRequest, int] | None
                  ) -> KVCacheBlocks | None:
        managers = self.managers
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        if num_computed:
            for manager in managers:
                manager.remove_skipped_blocks(request_id, num_computed)
        num_tokens = num_computed + num_hit + num_new_tokens
        needed = 0
        for manager, blocks in zip(managers, hit_blocks, strict=True):
            needed += manager.get_num_blocks_to_allocate(
                request_id, manager.num_tokens_for(request, num_tokens), blocks)
        pool = self.block_pool  # its lock is held: read the queues directly
        if needed > pool.fresh.num_free_blocks + pool.evictable.num_free_blocks:
            return None
        if num_hit:
            for manager, blocks in zip(managers, hit_blocks, strict=True):
                manager.add_computed_blocks(request_id, blocks)
            request.num_computed_tokens = num_hit
        out = KVCacheBlocks(tuple(
            manager.allocate_new_blocks(request_id, manager.num_tokens_for(request, num_tokens))
            for manager in managers))
        self._live[request_id] = (request, num_tokens if live is None
                                  else max(live[1], num_tokens))
        return out

    def _check_hit(self, request: KVCacheRequest, cache_hit: CacheHit | None,
                   live: tuple[KVCacheRequest, int] | None) -> tuple[_HitBlocks, int]:
        """The hit's blocks and length, checked against this manager's pool and the request's
        own block hashes before anything changes (O(blocks in the hit))."""
        if cache_hit is None:
            return self._no_hit, 0
        num_hit = check_int("allocate_slots: cache_hit.num_computed_tokens",
                            cache_hit.num_computed_tokens, 0)
        blocks = cache_hit.blocks
        if not isinstance(blocks, tuple):
            raise TypeError(f"allocate_slots: cache_hit.blocks must be a tuple of one list of "
                            f"blocks per group, got {type(blocks).__name__}")
        if len(blocks) != len(self.managers):
            raise ValueError(f"allocate_slots: the cache hit is from another manager (it has "
                             f"{len(blocks)} groups, this manager {len(self.managers)})")
        if not num_hit and not any(blocks):
            return self._no_hit, 0
        request_id = request.request_id
        if live is not None or request.num_computed_tokens:
            raise ValueError(f"allocate_slots: a cache hit can only be attached to a new "
                             f"request; {request_id!r} already has state")
        if num_hit % self._hit_alignment or num_hit >= request.num_tokens:
            raise ValueError(f"allocate_slots: a cache hit of {num_hit} tokens cannot be "
                             f"request {request_id!r}'s ({request.num_tokens} tokens; hits are "
                             f"multiples of {self._hit_alignment} below that)")
        for manager, group in zip(self.managers, blocks, strict=True):
            self._check_hit_group(request, manager, group, num_hit)
        return blocks, num_hit

    def _check_hit_group(self, request: KVCacheRequest, manager: SingleTypeKVCacheManager,
                         group: object, num_hit: int) -> None:
        group_id = manager.kv_cache_group_id
        expected = num_hit // manager.block_size if manager.enable_caching else 0
        if not isinstance(group, (list, tuple)) or len(group) != expected:
            raise ValueError(f"allocate_slots: the cache hit is not this manager's: group "
                             f"{group_id} needs {expected} blocks for {num_hit} hit tokens")
        if not expected:
            return
        hashes = group_block_hashes(request, manager.block_size)
        pool = self.block_pool
        null, owned, num_blocks = pool.null_block, pool.blocks, pool.num_blocks
        for i, block in enumerate(group):
            if block is null and manager.hit_may_hold_null_blocks:
                continue
            if not isinstance(block, KVCacheBlock):
                raise TypeError(f"allocate_slots: the cache hit holds {block!r} "
                                f"({type(block).__name__}), not a KVCacheBlock")
            block_id = block.block_id
            where = f"block {block_id} (group {group_id}, position {i})"
            if not 0 < block_id < num_blocks or owned[block_id] is not block:
                raise ValueError(f"allocate_slots: the cache hit is not this manager's: {where}"
                                 f" is not a block of its pool")
            if block.block_hash is None or block.hash_group != group_id:
                raise StaleCacheHitError(
                    f"allocate_slots: the cache hit is stale: {where} was evicted from the "
                    f"prefix cache; call get_computed_blocks again")
            if block.block_hash != hashes[i]:
                raise StaleCacheHitError(
                    f"allocate_slots: the cache hit is stale or another request's: {where} "
                    f"caches tokens other than those of request {request.request_id!r}; call "
                    f"get_computed_blocks again")

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int | None = None
                     ) -> None:
        """Report that the KV of the first ``num_computed_tokens`` tokens is written.

        Sets ``request.num_computed_tokens`` (never backwards; default: leave it) and publishes
        the full blocks among those tokens to the prefix cache. Call it after each step, for a
        request that holds slots (``allocate_slots``) for those tokens: ``ValueError`` for more
        tokens than the request has or its slots cover, or a request holding no blocks here.
        """
        if num_computed_tokens is not None and (type(num_computed_tokens) is not int
                                                or num_computed_tokens < 0):
            check_int("cache_blocks: num_computed_tokens", num_computed_tokens, 0)
        with self._lock:
            live = self._check_request("cache_blocks", request)
            if live is None:
                raise ValueError(f"cache_blocks: request {request.request_id!r} holds no slots "
                                 f"in this manager (call allocate_slots first, and again after "
                                 f"free)")
            if num_computed_tokens is not None:
                self._advance(request, num_computed_tokens, live[1])
            if not self.enable_caching:
                return
            num_tokens = request.num_computed_tokens
            for manager in self._hit_managers:
                manager.cache_blocks(request, num_tokens)

    @staticmethod
    def _advance(request: KVCacheRequest, num_computed_tokens: int, num_slots: int) -> None:
        if num_computed_tokens > request.num_tokens:
            raise ValueError(f"cache_blocks: {num_computed_tokens} computed tokens, but "
                             f"request {request.request_id!r} has {request.num_tokens}")
        if num_computed_tokens > num_slots:
            raise ValueError(f"cache_blocks: {num_computed_tokens} computed tokens, but "
                             f"request {request.request_id!r} has slots for {num_slots} "
                             f"(allocate_slots first)")
        if num_computed_tokens > request.num_computed_tokens:
            request.num_computed_tokens = num_computed_tokens

    def free(self, request: KVCacheRequest | str) -> None:
        """Release every block of the request (tail first, so prefixes outlive their tails).

        ``request`` is the request or its id. Cached blocks stay in the prefix cache until
        evicted. The request object is reset to ``num_computed_tokens = 0`` (freed by id too)
        so that it can be scheduled again from scratch. Freeing a request that holds nothing
        only resets it.
        """
        if isinstance(request, str):
            request_id, given = request, None
        elif isinstance(request, KVCacheRequest):
            request_id, given = request.request_id, request
        else:
            raise TypeError(f"free: expected a KVCacheRequest or a request id (str), got "
                            f"{request!r} ({type(request).__name__})")
        with self._lock:
            live = self._live.get(request_id)
            if live is not None and given is not None and live[0] is not given:
                raise ValueError(f"free: another request object with id {request_id!r} holds "
                                 f"blocks in this manager; free that one (or free by id)")
            for manager in self.managers:
                manager.free(request_id)
            if live is not None:
                del self._live[request_id]
                live[0].num_computed_tokens = 0
            if given is not None:
                given.num_computed_tokens = 0

    # -- queries ---------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block table per group (copies)."""
        _check_request_id("get_blocks", request_id)
        with self._lock:
            return tuple(list(manager.get_blocks(request_id)) for manager in self.managers)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (null entries are block 0)."""
        _check_request_id("get_block_ids", request_id)
        with self._lock:
            return tuple([block.block_id for block in manager.get_blocks(request_id)]
                         for manager in self.managers)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free in the shared pool."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """The fraction of the pool in use."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / looked-up tokens since the start (0.0 before any lookup)."""
        with self._lock:
            if not self.num_prefix_queries:
                return 0.0
            return self.num_prefix_hits / self.num_prefix_queries

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only when no request holds blocks (returns whether it did).
        """
        return self.block_pool.reset_prefix_cache()


def _check_request_id(what: str, request_id: object) -> None:
    if not isinstance(request_id, str):
        raise TypeError(f"{what}: expected a request id (str), got {request_id!r} "
                        f"({type(request_id).__name__})")


def _check_groups(kv_cache_groups: object) -> list[KVCacheGroupSpec]:
    """The groups as a list: ``TypeError`` unless an iterable of ``KVCacheGroupSpec``,
    ``ValueError`` when empty."""
    if isinstance(kv_cache_groups, (str, bytes, Mapping)) or not isinstance(
            kv_cache_groups, Iterable):
        raise TypeError(f"KVCacheManager: kv_cache_groups must be a sequence of "
                        f"KVCacheGroupSpec (get_kv_cache_groups; or use from_specs), got "
                        f"{type(kv_cache_groups).__name__}")
    groups = list(kv_cache_groups)
    if not groups:
        raise ValueError("KVCacheManager: no KV-cache groups (the model has no KV cache)")
    for i, group in enumerate(groups):
        if not isinstance(group, KVCacheGroupSpec):
            raise TypeError(f"KVCacheManager: kv_cache_groups[{i}] must be a KVCacheGroupSpec "
                            f"(get_kv_cache_groups; or use from_specs), got {group!r} "
                            f"({type(group).__name__})")
    return groups


def _check_cache_config(cache_config: object) -> CacheConfig:
    if cache_config is None:
        return CacheConfig()
    if not isinstance(cache_config, CacheConfig):
        raise TypeError(f"KVCacheManager: cache_config must be an app.config.CacheConfig or "
                        f"None, got {cache_config!r} ({type(cache_config).__name__})")
    return cache_config
