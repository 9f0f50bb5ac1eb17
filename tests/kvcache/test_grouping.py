"""get_kv_cache_groups: uniform, hybrid, page-size unification and its errors."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from app.containers import Application
from app.kvcache import (
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecBindings,
    KVCacheSpecRegistry,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_bytes_per_block,
    get_kv_cache_groups,
    unify_kv_cache_spec_page_size,
)


def bindings() -> KVCacheSpecBindings:
    """The bindings of the active container (the fixture's fresh one)."""
    return KVCacheSpecRegistry.bindings()

ATTN: dict[str, Any] = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
FULL = FullAttentionSpec(block_size=16, **ATTN)
SW = SlidingWindowSpec(block_size=16, sliding_window=1024, **ATTN)


def test_empty_model_has_no_groups() -> None:
    assert get_kv_cache_groups({}, bindings()) == []
    assert get_kv_cache_bytes_per_block([]) == 0


def test_uniform_layers_form_one_group() -> None:
    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)
    specs = {"a": FULL, "b": mla, "c": FullAttentionSpec(block_size=16, num_kv_heads=2,
                                                        head_size=64, dtype="fp16")}
    (group,) = get_kv_cache_groups(specs, bindings())
    assert group.layer_names == ("a", "b", "c") and group.kv_cache_spec is FULL
    assert group.page_size_bytes == sum(s.page_size_bytes for s in specs.values())
    assert get_kv_cache_bytes_per_block([group]) == group.page_size_bytes
    assert group.describe()["spec"]["type"] == "FullAttentionSpec"
    assert group.max_memory_usage_bytes(160) == 10 * group.page_size_bytes


def test_hybrid_full_and_sliding_window() -> None:
    specs = {**{f"full.{i}": FULL for i in range(2)}, **{f"sw.{i}": SW for i in range(6)}}
    groups = get_kv_cache_groups(specs, bindings())
    assert [g.layer_names for g in groups] == [
        ("full.0", "full.1"), ("sw.0", "sw.3"), ("sw.1", "sw.4"), ("sw.2", "sw.5")]
    assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec] + [SlidingWindowSpec] * 3
    assert get_kv_cache_bytes_per_block(groups) == FULL.page_size_bytes * 2


def test_hybrid_pads_to_the_larger_group_size() -> None:
    specs = {**{f"full.{i}": FULL for i in range(3)}, **{f"sw.{i}": SW for i in range(4)}}
    groups = get_kv_cache_groups(specs, bindings())
    assert [len(g.layer_names) for g in groups] == [3, 4]
    assert get_kv_cache_bytes_per_block(groups) == FULL.page_size_bytes * 4


def test_different_windows_are_different_groups() -> None:
    other = SW.copy_with(sliding_window=512)
    groups = get_kv_cache_groups({"a": SW, "b": other}, bindings())
    assert len(groups) == 2


def test_page_sizes_unify_by_block_size() -> None:
    small = SlidingWindowSpec(block_size=16, sliding_window=1024, num_kv_heads=4, head_size=128,
                              dtype=torch.bfloat16)
    groups = get_kv_cache_groups({"full": FULL, "sw": small}, bindings())
    assert groups[1].kv_cache_spec.block_size == 32
    assert groups[1].kv_cache_spec.page_size_bytes == FULL.page_size_bytes


def test_mamba_page_is_padded() -> None:
    mamba = MambaSpec(block_size=16, shapes=[[100]], dtypes=["bf16"])
    unified = unify_kv_cache_spec_page_size({"full": FULL, "m": mamba})
    assert unified["m"].page_size_bytes == FULL.page_size_bytes
    groups = get_kv_cache_groups({"full": FULL, "m": mamba}, bindings())
    assert len(groups) == 2


def test_page_sizes_that_cannot_be_unified_are_explained() -> None:
    odd = SlidingWindowSpec(block_size=16, sliding_window=1024, num_kv_heads=3, head_size=128,
                            dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        get_kv_cache_groups({"full": FULL, "odd": odd}, bindings())
    message = str(info.value)
    assert "'odd'" in message and "'full'" in message
    assert str(odd.page_size_bytes) in message and str(FULL.page_size_bytes) in message
    assert "does not divide" in message


def test_unregistered_layers_are_rejected_before_grouping() -> None:
    @attrs.frozen(kw_only=True)
    class Orphan(KVCacheSpec):
        @property
        def page_size_bytes(self) -> int:
            return 1

    with pytest.raises(ValueError, match="Unsupported KV cache spec type for layer x"):
        get_kv_cache_groups({"a": FULL, "x": Orphan(block_size=16)}, bindings())


# -- vLLM's one-argument form, get_kv_cache_groups(specs) (the KV-cache seed's) ------------------

def test_the_one_argument_form_groups_as_the_active_containers_bindings_do(
        kv_container: Application) -> None:
    specs = {"full.0": FULL, "sw.0": SW, "full.1": FULL, "sw.1": SW}
    groups = get_kv_cache_groups(specs)
    assert groups == get_kv_cache_groups(specs, bindings()) and len(groups) == 2

    @attrs.frozen(kw_only=True)
    class Registered(KVCacheSpec):
        """A spec only the active container knows."""

        @property
        def page_size_bytes(self) -> int:
            return 64

    manager = kv_container.kv_cache_spec_bindings().get_manager_class(FULL)
    KVCacheSpecRegistry.register(Registered, manager)
    custom = {"a": Registered(block_size=16), "b": Registered(block_size=16)}
    (group,) = get_kv_cache_groups(custom)               # found through the active container
    assert group.layer_names == ("a", "b")
    with pytest.raises(ValueError, match="Unsupported KV cache spec type for layer b"):
        get_kv_cache_groups(custom, KVCacheSpecBindings())   # standalone: built-ins only


def test_the_one_argument_form_uses_the_bindings_in_effect() -> None:
    from app.kvcache.grouping import default_kv_cache_spec_bindings
    from app.kvcache.specs import uniformity_bindings

    own = KVCacheSpecBindings()
    with uniformity_bindings(own):
        assert default_kv_cache_spec_bindings() is own
        assert get_kv_cache_groups({"a": FULL, "b": FULL}) == get_kv_cache_groups(
            {"a": FULL, "b": FULL}, own)
    with pytest.raises(TypeError, match="bindings must be KVCacheSpecBindings"):
        get_kv_cache_groups({"a": FULL}, "bindings")  # type: ignore[arg-type]
