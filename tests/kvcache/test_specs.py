"""Spec page sizes, memory bounds, validation, hashing and uniformity rules."""

from __future__ import annotations

import attrs
import pytest
import torch

from app.config import ModelConfig
from app.kvcache import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVCacheSpecBindings,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
)

ATTN = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}


def full(block_size: int = 16, **kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **{**ATTN, **kw})  # type: ignore[arg-type]


def test_full_attention_page_size_is_k_plus_v() -> None:
    spec = full()
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert spec.max_memory_usage_bytes(1000) == 63 * spec.page_size_bytes  # cdiv(1000, 16)
    assert spec.max_num_blocks_per_request(1000) == 63


def test_dtype_names_and_fp8() -> None:
    assert full(dtype="bf16").dtype is torch.bfloat16
    assert full(dtype="fp8").page_size_bytes == 2 * 16 * 8 * 128
    with pytest.raises(ValueError, match="unknown KV-cache dtype"):
        full(dtype="float13")
    with pytest.raises(TypeError):
        full(dtype=3)


def test_specs_are_frozen_kw_only_hashable() -> None:
    a, b = full(), full()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.block_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 8, 128, torch.bfloat16)  # type: ignore[call-arg]
    # Different classes with equal fields are different specs.
    assert full() != SinkFullAttentionSpec(block_size=16, sink_len=16, **ATTN)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_block_size_validation(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        full(block_size=bad)  # type: ignore[arg-type]


def test_mla_page_is_one_latent_vector_per_token() -> None:
    spec = MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                      dtype="bfloat16")
    assert spec.num_kv_heads == 1 and spec.head_size == 576
    assert spec.page_size_bytes == 16 * 576 * 2
    assert isinstance(spec, FullAttentionSpec)
    from_model = MLAAttentionSpec.from_model_config(ModelConfig(), block_size=16)
    assert from_model == spec


def test_tq_hidden_sink_cross_pages() -> None:
    tq = TQFullAttentionSpec(block_size=16, tq_slot_size=136, **ATTN)  # type: ignore[arg-type]
    assert tq.page_size_bytes == 16 * 8 * 136
    hidden = HiddenStateCacheSpec(block_size=16, head_size=4096, dtype=torch.float16)
    assert hidden.page_size_bytes == 16 * 4096 * 2
    sink = SinkFullAttentionSpec(block_size=16, sink_len=32, **ATTN)  # type: ignore[arg-type]
    assert sink.page_size_bytes == full().page_size_bytes
    cross = CrossAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]
    assert cross.max_memory_usage_bytes(4096, max_num_encoder_tokens=1500) == \
        94 * cross.page_size_bytes


def test_sliding_window_memory_is_bounded_by_window() -> None:
    sw = SlidingWindowSpec(block_size=16, sliding_window=4096, **ATTN)  # type: ignore[arg-type]
    # window-1 + one step of 2048 tokens, plus one block for a window that straddles blocks
    assert sw.max_num_blocks_per_request(100_000, max_num_batched_tokens=2048) == \
        -(-(4095 + 2048) // 16) + 1
    # never more than the full length
    assert sw.max_num_blocks_per_request(1024) == 64
    swmla = SlidingWindowMLASpec(block_size=16, sliding_window=128, head_size=576,
                                 dtype=torch.bfloat16)
    assert swmla.page_size_bytes == 16 * 576 * 2


def test_chunked_local_memory() -> None:
    spec = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=8192, **ATTN)  # type: ignore[arg-type]
    assert spec.max_num_blocks_per_request(100_000, max_num_batched_tokens=2048) == \
        (8192 + 2048) // 16


def test_mamba_page_is_the_state() -> None:
    spec = MambaSpec(block_size=64, shapes=[[4, 1024], [16, 64, 128]],
                     dtypes=["bf16", torch.float32])
    assert spec.shapes == ((4, 1024), (16, 64, 128))
    assert spec.page_size_bytes == 4 * 1024 * 2 + 16 * 64 * 128 * 4
    assert spec.max_memory_usage_bytes(10**6) == 2 * spec.page_size_bytes
    padded = spec.copy_with(page_size_padded=spec.page_size_bytes + 100)
    assert padded.page_size_bytes == spec.page_size_bytes + 100
    with pytest.raises(ValueError, match="smaller"):
        spec.copy_with(page_size_padded=10)
    with pytest.raises(ValueError, match="one dtype per state"):
        MambaSpec(block_size=64, shapes=[[4]], dtypes=["bf16", "bf16"])
    hash(spec)


def test_padded_attention_page() -> None:
    spec = full(page_size_padded=full().page_size_bytes * 2)
    assert spec.page_size_bytes == 2 * spec.real_page_size_bytes
    with pytest.raises(ValueError):
        full(page_size_padded=1)


#: The uniformity check takes the bindings it reads (here: built-ins only, no platform hook).
BINDINGS = KVCacheSpecBindings()


def test_base_page_size_is_abstract() -> None:
    with pytest.raises(NotImplementedError):
        _ = KVCacheSpec(block_size=16).page_size_bytes


# -- uniformity -------------------------------------------------------------------------------

def test_full_attention_family_is_uniform() -> None:
    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)
    tq = TQFullAttentionSpec(block_size=16, tq_slot_size=64, **ATTN)  # type: ignore[arg-type]
    sink = SinkFullAttentionSpec(block_size=16, sink_len=16, **ATTN)  # type: ignore[arg-type]
    hidden = HiddenStateCacheSpec(block_size=16, head_size=64, dtype=torch.bfloat16)
    specs = {"a": full(), "b": mla, "c": tq, "d": sink, "e": hidden}
    for spec in specs.values():
        assert spec.is_uniform_with_collection(specs, BINDINGS)
    sw = SlidingWindowSpec(block_size=16, sliding_window=128, **ATTN)  # type: ignore[arg-type]
    assert not full().is_uniform_with_collection({"a": full(), "b": sw}, BINDINGS)


def test_sliding_window_rule_adds_window_and_block_size() -> None:
    def sw(window: int, block: int = 16) -> SlidingWindowSpec:
        return SlidingWindowSpec(block_size=block, sliding_window=window, **ATTN)  # type: ignore[arg-type]

    assert sw(128).is_uniform_with_collection([sw(128), sw(128)], BINDINGS)
    assert not sw(128).is_uniform_with_collection([sw(128), sw(256)], BINDINGS)
    assert not sw(128).is_uniform_with_collection([sw(128), sw(128, block=32)], BINDINGS)
    assert not sw(128).is_uniform_with_collection([sw(128), full()], BINDINGS)


def test_chunked_and_mamba_rules() -> None:
    def chunked(size: int) -> ChunkedLocalAttentionSpec:
        return ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=size, **ATTN)  # type: ignore[arg-type]

    assert chunked(8192).is_uniform_with_collection([chunked(8192)], BINDINGS)
    assert not chunked(8192).is_uniform_with_collection([chunked(8192), chunked(4096)], BINDINGS)
    m1 = MambaSpec(block_size=64, shapes=[[4, 8]], dtypes=["bf16"])
    m2 = MambaSpec(block_size=64, shapes=[[4, 16]], dtypes=["bf16"])
    assert m1.is_uniform_with_collection([m1, m1], BINDINGS)
    assert not m1.is_uniform_with_collection([m1, m2], BINDINGS)
    assert not m1.is_uniform_with_collection([m1, m1.copy_with(block_size=32)], BINDINGS)


def test_first_specs_rule_applies() -> None:
    # Full's rule (isinstance of FullAttentionSpec) accepts MLA; MLA's base is Full too.
    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)
    assert full().is_uniform_with_collection([full(), mla], BINDINGS)
    assert mla.is_uniform_with_collection([mla, full()], BINDINGS)
    # A sliding-window MLA spec passes the sliding-window rule (subclass, same window) ...
    swmla = SlidingWindowMLASpec(block_size=16, sliding_window=128, head_size=576,
                                 dtype=torch.bfloat16)
    sw = SlidingWindowSpec(block_size=16, sliding_window=128, **ATTN)  # type: ignore[arg-type]
    assert sw.is_uniform_with_collection([sw, swmla], BINDINGS)
    # ... but not the other way round: its own base is SlidingWindowMLASpec.
    assert not swmla.is_uniform_with_collection([swmla, sw], BINDINGS)


def test_unregistered_spec_uniformity_raises_value_error() -> None:
    @attrs.frozen(kw_only=True)
    class Orphan(KVCacheSpec):
        @property
        def page_size_bytes(self) -> int:
            return 1

    with pytest.raises(ValueError, match="Unsupported KV cache spec type"):
        Orphan(block_size=16).is_uniform_with_collection([], BINDINGS)


@pytest.mark.parametrize("spec", [
    full(), MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                       dtype=torch.bfloat16),
    SlidingWindowSpec(block_size=16, sliding_window=64, **ATTN),
    ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64, **ATTN),
    CrossAttentionSpec(block_size=16, **ATTN),
    MambaSpec(block_size=16, shapes=[(4,)], dtypes=["fp16"]),
], ids=lambda spec: type(spec).__name__)
def test_memory_bounds_need_positive_int_lengths(spec: KVCacheSpec) -> None:
    # SlidingWindowSpec.max_memory_usage_bytes(-5) was -128; "x" a bare TypeError.
    for bad, error in [(-5, ValueError), (0, ValueError), ("x", TypeError), (1.5, TypeError),
                       (True, TypeError)]:
        with pytest.raises(error, match="max_model_len: expected an int >= 1"):
            spec.max_memory_usage_bytes(bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="max_model_len: expected an int >= 1"):
            spec.max_num_blocks_per_request(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected an int >= 1"):
        spec.max_memory_usage_bytes(64, max_num_batched_tokens=-1)
    assert spec.max_memory_usage_bytes(64, max_num_batched_tokens=16) > 0
