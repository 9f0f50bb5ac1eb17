"""The paged KV cache: specs, the spec -> manager registry, block pool, managers, grouping.

Usage (an engine, a scheduler, or the MLA prefill executor)
-----------------------------------------------------------

Create a manager for ``{layer_name: spec}`` and a ``CacheConfig``::

    import torch
    from app import get_container
    from app.config import CacheConfig
    from app.kvcache import KVCacheManager, MLAAttentionSpec

    spec = MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                      dtype=torch.bfloat16)      # page: 16 * 576 * 2 bytes
    manager = KVCacheManager.from_specs(
        {f"model.layers.{i}.self_attn": spec for i in range(num_layers)},
        CacheConfig(block_size=16, num_blocks=4096, enable_prefix_caching=True),
        bindings=get_container().kv_cache_spec_bindings())

``from_specs`` groups the layers (``get_kv_cache_groups``: identical MLA layers form one
group, group 0) and builds one ``BlockPool`` of ``num_blocks`` blocks (block 0 is the null
block, never handed out) shared by every group, with the manager class each group's spec is
bound to in the container's bindings (``MLAAttentionSpec`` -> ``FullAttentionManager``). The
tensors are the engine's: block id ``b`` of group ``g`` is page ``b`` of that group's layers.

Per request, in scheduler order::

    req = manager.new_request("req-1", prompt_token_ids)   # hashes full blocks of its tokens
    hit = manager.get_computed_blocks(req)                  # prefix-cache lookup (new requests)
    hit.num_computed_tokens       # tokens whose KV is already cached (<= num_tokens - 1;
                                  # a multiple of the block size); 0 without a hit
    new = manager.allocate_slots(req, req.num_tokens - hit.num_computed_tokens, hit)
    if new is None:               # the pool cannot fit it: nothing was allocated or attached;
        ...                       # retry later (or preempt someone and manager.free them)
    # allocate_slots attached the hit: req.num_computed_tokens == hit.num_computed_tokens
    block_ids = manager.get_block_ids(req.request_id)[0]   # group 0's block table (all blocks,
                                                            # cached prefix first)
    # ... run the step: read the cached prefix from block_ids, write the new tokens' KV
    #     (token t goes to block block_ids[t // 16], slot t % 16) ...
    manager.cache_blocks(req, req.num_tokens)   # the KV of the first n tokens is written:
                                                # sets req.num_computed_tokens, publishes the
                                                # full blocks for prefix reuse by later requests
    # decode: req.append_token_ids(tok); manager.allocate_slots(req, 1); run;
    #         manager.cache_blocks(req, req.num_tokens) ...
    manager.free(req)             # when finished or preempted (or manager.free("req-1")):
                                  # blocks go back, tail first; cached ones stay reusable
                                  # until evicted; req.num_computed_tokens is reset to 0

Rules: call ``cache_blocks`` only after the KV is really written (a hit reads those blocks),
and only for tokens ``allocate_slots`` gave slots to (more is a ``ValueError``, and so is a
request that holds no blocks); pass a ``CacheHit`` to ``allocate_slots`` straight away (until
then it reserves nothing and its blocks may be evicted: ``allocate_slots`` checks every hit
block against the request's own block hashes and refuses a stale hit with
``StaleCacheHitError``, a ``ValueError``, changing nothing: look it up again); requests must
be hashed at ``manager.hash_block_size`` (``new_request`` does it); a request id names one
request object while it holds blocks (a second object with that id is a ``ValueError``).
``get_block_ids`` / ``get_blocks`` give each group's table; ``KVCacheBlocks.get_block_ids()``
the blocks just allocated.

Threads: ``KVCacheManager`` and ``BlockPool`` are thread-safe. Every public method holds the
pool's re-entrant ``lock`` (the manager shares its pool's), so an engine may call the manager
from several threads, each driving its own requests; a hit looked up in one thread can go stale
when another allocates before it is attached (``allocate_slots`` then raises
``StaleCacheHitError``: catch it and look the request up again).
Hold ``manager.block_pool.lock`` to make a lookup and its allocation one atomic step.

Registry
--------

Each container holds one ``KVCacheSpecBindings`` (``container.kv_cache_spec_bindings()``,
``app.kvcache.bindings``), built with the container's platform and config: built-ins are
registered on first use, then the platform's ``register_custom_kv_cache_specs(bindings,
config)`` hook runs once. An engine passes its bindings in: ``get_kv_cache_groups(specs,
bindings)`` and ``KVCacheManager(groups, cache_config, bindings=bindings)``.
``KVCacheSpecRegistry`` (vLLM's classmethods) and ``register_kv_cache_spec`` are the seed API
over the *active* container's bindings (``use_container`` isolates); they live in
``seed_api.py`` (gathered with the backend one in ``app.seed_api``) and are re-exported here.
``spec.is_uniform_with_collection(specs)`` (vLLM's one-argument form) uses the bindings
grouping puts in effect, else the active container's.
"""

from app.kvcache.bindings import KVCacheSpecBindings, KVCacheSpecMetadata
from app.kvcache.block_pool import BlockHash, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from app.kvcache.cache_dtypes import (
    LatentCacheFormat,
    dequantize_fp8_ds_mla,
    ds_mla_row_bytes,
    quantize_fp8_ds_mla,
)
from app.kvcache.grouping import (
    KVCacheGroupSpec,
    get_kv_cache_bytes_per_block,
    get_kv_cache_groups,
    unify_kv_cache_spec_page_size,
)
from app.kvcache.kv_cache_manager import (
    CacheHit,
    KVCacheBlocks,
    KVCacheManager,
    StaleCacheHitError,
)
from app.kvcache.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)
from app.kvcache.request import KVCacheRequest, hash_block_tokens
from app.kvcache.seed_api import KVCacheSpecRegistry, register_kv_cache_spec
from app.kvcache.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
)

__all__ = [
    "AttentionSpec",
    "BlockHash",
    "BlockPool",
    "CacheHit",
    "ChunkedLocalAttentionManager",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "HiddenStateCacheSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheRequest",
    "KVCacheSpec",
    "KVCacheSpecBindings",
    "KVCacheSpecMetadata",
    "KVCacheSpecRegistry",
    "LatentCacheFormat",
    "MLAAttentionSpec",
    "MambaManager",
    "MambaSpec",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "StaleCacheHitError",
    "TQFullAttentionSpec",
    "dequantize_fp8_ds_mla",
    "ds_mla_row_bytes",
    "get_kv_cache_bytes_per_block",
    "get_kv_cache_groups",
    "hash_block_tokens",
    "quantize_fp8_ds_mla",
    "register_kv_cache_spec",
    "unify_kv_cache_spec_page_size",
]
