"""Hostile token ids and salts for ``KVCacheRequest`` (issue 21): a typed error naming the
value, nothing appended on an error, and bytes never read as raw int64 words."""

from __future__ import annotations

import pytest

from app.kvcache import KVCacheRequest
from app.kvcache.request import hash_block_tokens


def _request() -> KVCacheRequest:
    return KVCacheRequest("r", list(range(10)), hash_block_size=4)


@pytest.mark.parametrize("tokens, error, message", [
    ([1, 2**70], ValueError, "int64 range, got 1180591620717411303424"),
    ([1, -2**63 - 1], ValueError, "int64 range, got -9223372036854775809"),
    (2**64, ValueError, "int64 range, got 18446744073709551616"),
    ([1, True], TypeError, "got True (bool)"),
    (True, TypeError, "iterable of ints, got bool"),
    (1.5, TypeError, "iterable of ints, got float"),
    ([1, 2.0], TypeError, "token ids must be ints"),
    ("12", TypeError, "iterable of ints, got str"),
    (b"\x01\x00\x00\x00\x00\x00\x00\x00", TypeError, "iterable of ints, got bytes"),
])
def test_appending_a_bad_token_appends_nothing(tokens: object, error: type[Exception],
                                               message: str) -> None:
    req = _request()
    before = (list(req.token_ids), list(req.block_hashes))
    with pytest.raises(error) as info:
        req.append_token_ids(tokens)  # type: ignore[arg-type]
    assert message in str(info.value) and "KVCacheRequest 'r'" in str(info.value)
    assert (list(req.token_ids), list(req.block_hashes)) == before


@pytest.mark.parametrize("tokens, error", [
    ([2**63], ValueError), ([False, 1], TypeError), (b"12345678", TypeError),
    (None, TypeError), ([[1]], TypeError)])
def test_bad_prompt_tokens(tokens: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="KVCacheRequest 'r': token ids"):
        KVCacheRequest("r", tokens)  # type: ignore[arg-type]
    with pytest.raises(error, match="hash_block_tokens: token ids"):
        hash_block_tokens(None, tokens)  # type: ignore[arg-type]


def test_a_salt_must_be_text_or_bytes() -> None:
    with pytest.raises(TypeError, match="cache_salt must be a str, bytes or None, got 5"):
        KVCacheRequest("r", [1, 2, 3, 4], hash_block_size=4, cache_salt=5)  # type: ignore[arg-type]


def test_good_tokens_still_hash_the_same() -> None:
    a = KVCacheRequest("a", range(8), hash_block_size=4)
    b = KVCacheRequest("b", [0, 1, 2, 3], hash_block_size=4)
    b.append_token_ids(4)
    b.append_token_ids((5, 6, 7))
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
