"""The built-in KV-cache spec bindings, as data: spec type -> (manager class, uniform base).

Full, MLA, TQFull, HiddenState and SinkFull share the full-attention base (they can share a
KV-cache group); every other built-in is its own base. The container hands this table to its
``KVCacheSpecBindings``; adding a built-in spec kind is one spec class, one manager (or an
existing one) and one line here.
"""

from __future__ import annotations

import app.kvcache.managers as m
import app.kvcache.specs as s

__all__ = ["BUILTIN_KV_CACHE_SPECS", "KVCacheSpecEntry"]

#: ``(spec type, manager class, uniform base spec)``.
KVCacheSpecEntry = tuple[type[s.KVCacheSpec], type[m.SingleTypeKVCacheManager],
                         type[s.KVCacheSpec]]

BUILTIN_KV_CACHE_SPECS: tuple[KVCacheSpecEntry, ...] = (
    (s.FullAttentionSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.MLAAttentionSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.TQFullAttentionSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.HiddenStateCacheSpec, m.FullAttentionManager, s.FullAttentionSpec),
    (s.SinkFullAttentionSpec, m.SinkFullAttentionManager, s.FullAttentionSpec),
    (s.SlidingWindowSpec, m.SlidingWindowManager, s.SlidingWindowSpec),
    (s.SlidingWindowMLASpec, m.SlidingWindowManager, s.SlidingWindowMLASpec),
    (s.ChunkedLocalAttentionSpec, m.ChunkedLocalAttentionManager, s.ChunkedLocalAttentionSpec),
    (s.CrossAttentionSpec, m.CrossAttentionManager, s.CrossAttentionSpec),
    (s.MambaSpec, m.MambaManager, s.MambaSpec),
)
