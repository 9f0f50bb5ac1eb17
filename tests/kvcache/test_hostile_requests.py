"""Hostile token ids and salts for ``KVCacheRequest`` (issue 21): a typed error naming the
value, nothing appended on an error, and bytes never read as raw int64 words."""

from __future__ import annotations

import pytest
import torch

from app.config import CacheConfig
from app.kvcache import KVCacheManager, KVCacheRequest, KVCacheSpecBindings, MLAAttentionSpec
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


def _manager() -> tuple[KVCacheManager, KVCacheRequest]:
    spec = MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=64, qk_rope_head_dim=32,
                                      dtype=torch.bfloat16)
    manager = KVCacheManager.from_specs({"l0": spec}, CacheConfig(block_size=16, num_blocks=8),
                                        bindings=KVCacheSpecBindings())
    return manager, manager.new_request("r", list(range(40)))


@pytest.mark.parametrize("count, error", [(True, TypeError), (1.5, TypeError), ("3", TypeError),
                                          (-1, ValueError)])
def test_token_counts_must_be_ints(count: object, error: type[Exception]) -> None:
    # True was taken as 1 token and 1.5 as none: nothing said.
    manager, req = _manager()
    free = manager.num_free_blocks
    with pytest.raises(error, match="allocate_slots: num_new_tokens: expected an int >= 0"):
        manager.allocate_slots(req, count)  # type: ignore[arg-type]
    with pytest.raises(error, match="allocate_slots: num_lookahead_tokens: expected an int"):
        manager.allocate_slots(req, 1, num_lookahead_tokens=count)  # type: ignore[arg-type]
    assert manager.num_free_blocks == free
    with pytest.raises(error, match="cache_blocks: num_computed_tokens: expected an int >= 0"):
        manager.cache_blocks(req, count)  # type: ignore[arg-type]
    assert req.num_computed_tokens == 0


def test_a_pool_beyond_int32_or_memory_is_refused_before_it_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from app.kvcache import block_pool

    # 2**40 blocks: building them never ended (nor would 2**31 - 1, ~300 GB of objects).
    with pytest.raises(ValueError, match="at most 2147483647 \\(block ids are int32\\)"):
        block_pool.BlockPool(2**40)
    monkeypatch.setattr(block_pool, "available_host_bytes", lambda: 1 << 30)
    with pytest.raises(ValueError, match=r"2147483647 blocks need 320.0 GiB of host memory .* "
                                         r"use at most 6710886 blocks"):
        block_pool.BlockPool(2**31 - 1)
    assert block_pool.BlockPool(1000).num_free_blocks == 999


@pytest.mark.parametrize("tokens", [{1: 2, 3: 4}, {3, 1, 2}, frozenset({1}), {1: 2}.keys()],
                         ids=["dict", "set", "frozenset", "keys"])
def test_unordered_prompts_are_refused(tokens: object) -> None:
    # A dict was taken as its keys, a set in arbitrary order: tokens the caller never meant.
    with pytest.raises(TypeError, match=r"token ids must be an ordered iterable of ints, got"):
        KVCacheRequest("r", tokens)  # type: ignore[arg-type]
    req = _request()
    with pytest.raises(TypeError, match="ordered iterable"):
        req.append_token_ids(tokens)  # type: ignore[arg-type]
    assert req.num_tokens == 10


def test_hash_parent_and_extra_must_be_bytes() -> None:
    with pytest.raises(TypeError, match=r"parent must be a block hash \(bytes\) or None, got 5"):
        hash_block_tokens(5, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="extra must be bytes or None, got 's'"):
        hash_block_tokens(None, [1], extra="s")  # type: ignore[arg-type]
    assert hash_block_tokens(hash_block_tokens(None, [1]), [2], b"salt") != hash_block_tokens(
        None, [2], b"salt")
