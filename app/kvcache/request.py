"""The request a scheduler hands to the KV-cache manager, and the chained block hashes.

A block hash is ``sha256(parent_hash || tokens || extra)``: it covers the block's tokens *and*
(through the parent) every token before it, so two requests share a cached block only when
their whole prefixes up to that block are equal. The first block's parent is a fixed root
digest; a ``cache_salt`` (per tenant, per LoRA adapter, ...) enters the first block's hash, so
requests with different salts never share blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from app._validation import check_int_at_least
from app.kvcache.block_pool import BlockHash

__all__ = ["ROOT_BLOCK_HASH", "KVCacheRequest", "hash_block_tokens"]

#: The parent hash of a request's first block.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"app.kvcache block hash root v1").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra: bytes | None = None) -> BlockHash:
    """The chained hash of one full block: ``sha256(parent || int64 tokens || extra)``.

    ``parent`` and ``extra`` are bytes or None (``TypeError`` otherwise).
    """
    if parent is not None and not isinstance(parent, bytes):
        raise TypeError(f"hash_block_tokens: parent must be a block hash (bytes) or None, got "
                        f"{parent!r} ({type(parent).__name__})")
    if extra is not None and not isinstance(extra, bytes):
        raise TypeError(f"hash_block_tokens: extra must be bytes or None, got {extra!r} "
                        f"({type(extra).__name__})")
    digest = hashlib.sha256(ROOT_BLOCK_HASH if parent is None else parent)
    digest.update(_token_array("hash_block_tokens", token_ids).tobytes())
    if extra:
        digest.update(b"\x00salt\x00")
        digest.update(extra)
    return digest.digest()


_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _token_array(what: str, token_ids: object) -> array[int]:
    """``token_ids`` (an ordered iterable of ints, not bools) as an ``array('q')``, checked
    whole before anything uses it: ``TypeError`` for a str/bytes, a mapping or a set (keys,
    or no order), a non-iterable or a non-int, ``ValueError`` for an int outside int64 (bytes
    would be read as raw int64 words)."""
    if isinstance(token_ids, (str, bytes, bytearray, memoryview, Mapping, AbstractSet)) or (
            not isinstance(token_ids, Iterable)):
        raise TypeError(f"{what}: token ids must be an ordered iterable of ints, got "
                        f"{type(token_ids).__name__}")
    tokens = list(token_ids)
    flag = next((t for t in tokens if isinstance(t, bool)), None)
    if flag is not None:
        raise TypeError(f"{what}: token ids must be ints, got {flag!r} (bool)")
    try:
        return array("q", tokens)  # takes anything with __index__, refuses floats
    except OverflowError:
        out = next(t for t in tokens if not _INT64_MIN <= int(t) <= _INT64_MAX)
        raise ValueError(f"{what}: token ids must be ints in the int64 range, got "
                         f"{int(out)}") from None
    except TypeError as exc:
        raise TypeError(f"{what}: token ids must be ints ({exc})") from None


class KVCacheRequest:
    """A request as the KV-cache manager sees it: its tokens, progress and block hashes.

    - ``request_id``: unique among live requests.
    - ``token_ids``: prompt tokens, then generated tokens (``append_token_ids``).
    - ``num_computed_tokens``: tokens whose KV is in the cache. The manager sets it when it
      applies a prefix-cache hit (``allocate_slots``) and when the engine reports progress
      (``KVCacheManager.cache_blocks(request, n)``); ``free`` resets it to 0.
    - ``block_hashes``: one chained hash per *full* block of ``hash_block_size`` tokens,
      kept up to date as tokens are appended.
    - ``num_encoder_tokens``: encoder input length (encoder-decoder models: cross attention).
    """

    __slots__ = ("_extra", "_token_ids", "block_hashes", "hash_block_size",
                 "num_computed_tokens", "num_encoder_tokens", "num_prompt_tokens", "request_id")

    def __init__(self, request_id: str, prompt_token_ids: Iterable[int], *,
                 hash_block_size: int = 16, cache_salt: str | bytes | None = None,
                 num_encoder_tokens: int = 0) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"KVCacheRequest: request_id must be a non-empty str, "
                            f"got {request_id!r}")
        check_int_at_least("KVCacheRequest: hash_block_size", hash_block_size, 1)
        check_int_at_least("KVCacheRequest: num_encoder_tokens", num_encoder_tokens, 0)
        if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"KVCacheRequest {request_id!r}: cache_salt must be a str, bytes or "
                            f"None, got {cache_salt!r} ({type(cache_salt).__name__})")
        self.request_id = request_id
        self._token_ids = _token_array(f"KVCacheRequest {request_id!r}", prompt_token_ids)
        self.num_prompt_tokens = len(self._token_ids)
        self.hash_block_size = hash_block_size
        self.num_encoder_tokens = num_encoder_tokens
        self.num_computed_tokens = 0
        self._extra = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._token_ids)

    @property
    def token_ids(self) -> Sequence[int]:
        """All tokens so far (an ``array('q')``; do not modify it, use ``append_token_ids``)."""
        return self._token_ids

    def append_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens; hashes of newly full blocks are computed. A token that is
        not an int in the int64 range is a ``TypeError``/``ValueError`` and nothing is
        appended."""
        what = f"KVCacheRequest {self.request_id!r}"
        if type(token_ids) is int:  # the engine's per-token call: no list, no array
            if not _INT64_MIN <= token_ids <= _INT64_MAX:
                raise ValueError(f"{what}: token ids must be ints in the int64 range, got "
                                 f"{token_ids}")
            self._token_ids.append(token_ids)
        else:
            self._token_ids.extend(_token_array(what, token_ids))
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self.hash_block_size
        hashes = self.block_hashes
        tokens = self._token_ids
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            extra = self._extra if start == 0 else None
            digest = hashlib.sha256(ROOT_BLOCK_HASH if parent is None else parent)
            digest.update(tokens[start:start + size].tobytes())
            if extra:
                digest.update(b"\x00salt\x00")
                digest.update(extra)
            parent = digest.digest()
            hashes.append(parent)

    def __repr__(self) -> str:
        return (f"KVCacheRequest({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
