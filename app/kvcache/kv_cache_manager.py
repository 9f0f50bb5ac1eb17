"""``KVCacheManager``: what a scheduler calls, over every KV-cache group of a model.

One ``BlockPool`` is shared by all groups; each group has the single-type manager its spec is
bound to in the active container's registry. See ``app.kvcache`` for the calling sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

from app._validation import check_int
from app.config import CacheConfig
from app.kvcache.bindings import KVCacheSpecBindings
from app.kvcache.block_pool import BlockPool, KVCacheBlock
from app.kvcache.grouping import KVCacheGroupSpec, get_kv_cache_groups
from app.kvcache.managers import SingleTypeKVCacheManager, group_block_hashes
from app.kvcache.request import KVCacheRequest
from app.kvcache.specs import KVCacheSpec

__all__ = ["CacheHit", "KVCacheBlocks", "KVCacheManager"]


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
    Pass it to ``allocate_slots`` right away: until then the blocks may be evicted.
    """

    blocks: tuple[list[KVCacheBlock], ...]
    num_computed_tokens: int

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The block ids per group."""
        return tuple([block.block_id for block in group] for group in self.blocks)


class KVCacheManager:
    """Allocates a model's paged KV cache for requests, with prefix caching.

    ``KVCacheManager(groups, cache_config, bindings=...)`` or ``KVCacheManager.from_specs({layer:
    spec}, cache_config, bindings=...)``; ``bindings`` is the container's ``KVCacheSpecBindings``
    (None asks the active container, the seed API's way). ``cache_config.num_blocks`` sizes the pool
    (block 0 is the null block) and ``cache_config.enable_prefix_caching`` turns caching on.
    Requests must hash their tokens at ``hash_block_size`` (``new_request`` does that).
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec],
                 cache_config: CacheConfig | None = None, *,
                 num_blocks: int | None = None, enable_caching: bool | None = None,
                 bindings: KVCacheSpecBindings | None = None) -> None:
        if not kv_cache_groups:
            raise ValueError("KVCacheManager: no KV-cache groups (the model has no KV cache)")
        config = CacheConfig() if cache_config is None else cache_config
        self.cache_config = config
        self.kv_cache_groups = list(kv_cache_groups)
        self.enable_caching = (config.enable_prefix_caching if enable_caching is None
                               else bool(enable_caching))
        self.block_pool = BlockPool(config.num_blocks if num_blocks is None else num_blocks,
                                    enable_caching=self.enable_caching)
        if bindings is None:
            from app.kvcache.registry import KVCacheSpecRegistry

            bindings = KVCacheSpecRegistry.bindings()
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
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found

    @classmethod
    def from_specs(cls, kv_cache_specs: Mapping[str, KVCacheSpec],
                   cache_config: CacheConfig | None = None, *, num_blocks: int | None = None,
                   enable_caching: bool | None = None,
                   bindings: KVCacheSpecBindings | None = None) -> KVCacheManager:
        """Group ``{layer_name: spec}`` (``get_kv_cache_groups``) and manage those groups."""
        return cls(get_kv_cache_groups(kv_cache_specs, bindings), cache_config,
                   num_blocks=num_blocks, enable_caching=enable_caching, bindings=bindings)

    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], *,
                    cache_salt: str | bytes | None = None,
                    num_encoder_tokens: int = 0) -> KVCacheRequest:
        """A ``KVCacheRequest`` hashed at this manager's ``hash_block_size``."""
        return KVCacheRequest(request_id, prompt_token_ids, hash_block_size=self.hash_block_size,
                              cache_salt=cache_salt, num_encoder_tokens=num_encoder_tokens)

    # -- the scheduler's calls --------------------------------------------------------------

    def _check_request(self, request: KVCacheRequest) -> None:
        if request.hash_block_size != self.hash_block_size:
            raise ValueError(f"request {request.request_id!r} hashes blocks of "
                             f"{request.hash_block_size} tokens; this manager needs "
                             f"{self.hash_block_size} (use KVCacheManager.new_request)")

    def holds(self, request_id: str) -> bool:
        """Whether the request holds blocks in any group."""
        return any(request_id in manager.req_to_blocks for manager in self.managers)

    def get_computed_blocks(self, request: KVCacheRequest) -> CacheHit:
        """The longest cached prefix of a new request, common to every group.

        At most ``num_tokens - 1`` tokens: the last token is always computed (its logits are
        needed). Empty when caching is off. Nothing is reserved: pass the hit straight to
        ``allocate_slots``.
        """
        self._check_request(request)
        empty: tuple[list[KVCacheBlock], ...] = tuple([] for _ in self.managers)
        if not self._hit_managers or request.num_computed_tokens:
            return CacheHit(empty, 0)
        if self.holds(request.request_id):
            raise ValueError(f"get_computed_blocks: request {request.request_id!r} already "
                             "holds blocks; cache hits are for new requests")
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
            return CacheHit(empty, 0)
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
        tokens. A ``cache_hit`` (from ``get_computed_blocks``, for a new request) is attached
        first and advances ``request.num_computed_tokens`` by its length. Returns None, with
        nothing allocated or attached, when the pool cannot fit it. Blocks that left a sliding
        window (or chunk) are freed first.
        """
        self._check_request(request)
        check_int("allocate_slots: num_new_tokens", num_new_tokens, 0)
        check_int("allocate_slots: num_lookahead_tokens", num_lookahead_tokens, 0)
        managers = self.managers
        request_id = request.request_id
        hit_blocks: tuple[Sequence[KVCacheBlock], ...] = tuple(() for _ in managers)
        num_hit = 0
        if cache_hit is not None and cache_hit.num_computed_tokens:
            if request.num_computed_tokens or self.holds(request_id):
                raise ValueError(f"allocate_slots: a cache hit can only be attached to a new "
                                 f"request; {request_id!r} already has state")
            if len(cache_hit.blocks) != len(managers):
                raise ValueError("allocate_slots: the cache hit is from another manager")
            hit_blocks = cache_hit.blocks
            num_hit = cache_hit.num_computed_tokens
        num_computed = request.num_computed_tokens
        if num_computed:
            for manager in managers:
                manager.remove_skipped_blocks(request_id, num_computed)
        num_tokens = num_computed + num_hit + num_new_tokens + num_lookahead_tokens
        needed = 0
        for manager, blocks in zip(managers, hit_blocks, strict=True):
            needed += manager.get_num_blocks_to_allocate(
                request_id, manager.num_tokens_for(request, num_tokens), blocks)
        if needed > self.block_pool.num_free_blocks:
            return None
        if num_hit:
            for manager, blocks in zip(managers, hit_blocks, strict=True):
                manager.add_computed_blocks(request_id, blocks)
            request.num_computed_tokens = num_hit
        return KVCacheBlocks(tuple(
            manager.allocate_new_blocks(request_id, manager.num_tokens_for(request, num_tokens))
            for manager in managers))

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int | None = None
                     ) -> None:
        """Report that the KV of the first ``num_computed_tokens`` tokens is written.

        Sets ``request.num_computed_tokens`` (never backwards; default: leave it) and publishes
        the full blocks among those tokens to the prefix cache. Call it after each step.
        """
        if num_computed_tokens is not None:
            check_int("cache_blocks: num_computed_tokens", num_computed_tokens, 0)
            if num_computed_tokens > request.num_tokens:
                raise ValueError(f"cache_blocks: {num_computed_tokens} computed tokens, but "
                                 f"request {request.request_id!r} has {request.num_tokens}")
            if num_computed_tokens > request.num_computed_tokens:
                request.num_computed_tokens = num_computed_tokens
        if not self.enable_caching:
            return
        num_tokens = request.num_computed_tokens
        for manager in self._hit_managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request: KVCacheRequest | str) -> None:
        """Release every block of the request (tail first, so prefixes outlive their tails).

        Cached blocks stay in the prefix cache until evicted. A request object is reset to
        ``num_computed_tokens = 0`` so that it can be scheduled again from scratch.
        """
        request_id = request if isinstance(request, str) else request.request_id
        for manager in self.managers:
            manager.free(request_id)
        if isinstance(request, KVCacheRequest):
            request.num_computed_tokens = 0

    # -- queries ---------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block table per group (copies)."""
        return tuple(list(manager.get_blocks(request_id)) for manager in self.managers)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (null entries are block 0)."""
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
        if not self.num_prefix_queries:
            return 0.0
        return self.num_prefix_hits / self.num_prefix_queries

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only when no request holds blocks (returns whether it did).
        """
        return self.block_pool.reset_prefix_cache()
