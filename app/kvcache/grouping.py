"""Grouping layers into KV-cache groups, and sizing the block pool for them.

A KV-cache group is a set of layers that share one block table per request, managed by one
single-type manager. All groups share one block pool, so every block id means the same amount
of memory in every group.

``get_kv_cache_groups({layer: spec}, bindings)`` (``bindings``: the container's
``KVCacheSpecBindings``, ``container.kv_cache_spec_bindings()``; ``get_kv_cache_groups(specs)``,
vLLM's one-argument form, uses the default bindings: see ``get_kv_cache_groups``):

1. Every spec type must be registered (``ValueError`` naming every unregistered layer).
2. *Uniform*: when all layers have one block size and the first spec's
   ``is_uniform_with_collection(specs)`` accepts them all (called in vLLM's one-argument form,
   with ``bindings`` in effect, so a third-party spec may override it with that signature),
   they form one group (a block then holds every layer's page: ``bytes_per_block`` is the sum
   of the layers' page sizes).
3. *Hybrid* otherwise: page sizes are unified first (a smaller attention page grows its block
   size by ``largest / page`` when that divides evenly; a Mamba state page is padded); layers
   whose specs are uniform with each other form a bucket; buckets are split into groups of
   equal layer count (layers ``i::n`` of a bucket, padding the last). A block then holds one
   page in each of ``group_size`` shared tensors: ``bytes_per_block = page * group_size``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from app.kvcache.bindings import KVCacheSpecBindings
from app.kvcache.specs import (
    KVCacheSpec,
    MambaSpec,
    cdiv,
    default_uniformity_lookup,
    spec_summary,
    uniformity_bindings,
)

__all__ = ["KVCacheGroupSpec", "default_kv_cache_spec_bindings", "get_kv_cache_bytes_per_block",
           "get_kv_cache_groups", "unify_kv_cache_spec_page_size"]


@attrs.frozen
class KVCacheGroupSpec:
    """One KV-cache group: its layers, their specs and the spec that picks the manager.

    ``kv_cache_spec`` is the first layer's spec: it decides the manager class and the block
    size of the group's block table. ``layer_specs`` follows ``layer_names``.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    layer_specs: tuple[KVCacheSpec, ...]

    @property
    def block_size(self) -> int:
        """Tokens per block of this group's table."""
        return self.kv_cache_spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes over all of this group's layers."""
        return sum(spec.page_size_bytes for spec in self.layer_specs)

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        """The most one request holds in this group (its largest layer, in this group's pages).
        """
        pages = max(spec.max_num_blocks_per_request(
            max_model_len, max_num_batched_tokens=max_num_batched_tokens)
            for spec in self.layer_specs)
        return pages * self.page_size_bytes

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        return {"layers": list(self.layer_names), "spec": spec_summary(self.kv_cache_spec),
                "block_size": self.block_size, "page_size_bytes": self.page_size_bytes}


def unify_kv_cache_spec_page_size(kv_cache_specs: Mapping[str, KVCacheSpec]
                                  ) -> dict[str, KVCacheSpec]:
    """Give every layer the largest page size, or explain why that is impossible.

    A smaller page whose size divides the largest grows its block size by the ratio; a Mamba
    state page is padded. Anything else raises ``ValueError`` naming both layers and sizes.
    """
    specs = dict(kv_cache_specs)
    if not specs:
        return specs
    pages = {name: spec.page_size_bytes for name, spec in specs.items()}
    largest_name = max(pages, key=lambda name: pages[name])
    largest = pages[largest_name]
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = pages[name]
        if page == largest:
            out[name] = spec
            continue
        new_spec: KVCacheSpec | None = None
        if isinstance(spec, MambaSpec):
            new_spec = spec.copy_with(page_size_padded=largest)
        elif largest % page == 0:
            try:
                new_spec = spec.copy_with(block_size=spec.block_size * (largest // page))
            except (TypeError, ValueError):
                new_spec = None
        if new_spec is None or new_spec.page_size_bytes != largest:
            raise ValueError(
                f"Cannot put these layers in one block pool: every KV-cache group shares the "
                f"pool's blocks, so every layer's page (bytes per block) must be the same size. "
                f"Layer {name!r} ({type(spec).__name__}, block_size {spec.block_size}) has "
                f"{page} bytes per block, which does not divide the largest page, {largest} "
                f"bytes (layer {largest_name!r}, {type(specs[largest_name]).__name__}). A "
                f"smaller page is unified by multiplying its block size by largest / page, and "
                f"a Mamba state page by padding; choose block sizes, head counts or head sizes "
                f"so that every page size divides the largest.")
        out[name] = new_spec
    return out


def _uniform(a: tuple[str, KVCacheSpec], b: tuple[str, KVCacheSpec]) -> bool:
    """Whether layers ``a`` and ``b`` (name, spec) share a bucket: each one's rule accepts the
    pair (passed as vLLM passes it, ``{layer_name: spec}``)."""
    pair = dict((a, b))
    return (a[1].block_size == b[1].block_size and a[1].is_uniform_with_collection(pair)
            and b[1].is_uniform_with_collection(pair))


def get_kv_cache_groups(kv_cache_specs: Mapping[str, KVCacheSpec],
                        bindings: KVCacheSpecBindings | None = None) -> list[KVCacheGroupSpec]:
    """Split ``{layer_name: spec}`` into KV-cache groups (see the module docstring).

    ``bindings``: the container's ``KVCacheSpecBindings`` (an engine passes
    ``container.kv_cache_spec_bindings()``). Omitted (vLLM's ``get_kv_cache_groups(specs)``,
    the form the KV-cache seed names): the default bindings, those
    ``spec.is_uniform_with_collection(specs)`` reads without any: the bindings in effect
    (``uniformity_bindings``), else the active container's once the seed API is loaded (it
    installs that default; ``app.kvcache.KVCacheSpecRegistry`` and ``register_kv_cache_spec``
    load it), else standalone bindings of the built-in specs. ``ValueError`` for unregistered
    spec types and for page sizes that cannot be unified.
    """
    if bindings is None:
        bindings = default_kv_cache_spec_bindings()
    if not isinstance(bindings, KVCacheSpecBindings):
        raise TypeError(f"get_kv_cache_groups: bindings must be KVCacheSpecBindings (the "
                        f"container's kv_cache_spec_bindings()), got {type(bindings).__name__}")
    if not isinstance(kv_cache_specs, Mapping):
        raise TypeError(f"get_kv_cache_groups: kv_cache_specs must be a mapping {{layer_name: "
                        f"spec}}, got {type(kv_cache_specs).__name__}")
    if not kv_cache_specs:
        return []
    bindings.check_kv_cache_spec_registry(kv_cache_specs)
    with uniformity_bindings(bindings):
        return _groups(kv_cache_specs)


def default_kv_cache_spec_bindings() -> KVCacheSpecBindings:
    """The bindings ``get_kv_cache_groups(specs)`` uses when given none (see there)."""
    found = default_uniformity_lookup()
    return found if isinstance(found, KVCacheSpecBindings) else _builtin_bindings()


@functools.cache
def _builtin_bindings() -> KVCacheSpecBindings:
    """Standalone bindings of the built-in specs (no platform hook), made once."""
    return KVCacheSpecBindings()


def _groups(kv_cache_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    names = list(kv_cache_specs)
    values = list(kv_cache_specs.values())
    first = values[0]
    if (len({spec.block_size for spec in values}) == 1
            and first.is_uniform_with_collection(dict(kv_cache_specs))):
        return [KVCacheGroupSpec(tuple(names), first, tuple(values))]

    unified = unify_kv_cache_spec_page_size(kv_cache_specs)
    buckets: list[list[str]] = []
    for name, spec in unified.items():
        for bucket in buckets:
            if _uniform((bucket[0], unified[bucket[0]]), (name, spec)):
                bucket.append(name)
                break
        else:
            buckets.append([name])

    sizes = [len(bucket) for bucket in buckets]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)  # pad a little rather than splitting into many groups
    groups = []
    for bucket in buckets:
        num_groups = cdiv(len(bucket), group_size)
        for i in range(num_groups):
            layer_names = tuple(bucket[i::num_groups])
            layer_specs = tuple(unified[name] for name in layer_names)
            groups.append(KVCacheGroupSpec(layer_names, layer_specs[0], layer_specs))
    return groups


def get_kv_cache_bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs across all groups (what a memory budget is divided by).

    One group: the sum of its layers' pages. Several (hybrid, one common page size): a block
    id indexes one page in each of ``group_size`` shared tensors, ``page * group_size``.
    """
    if not groups:
        return 0
    if len(groups) == 1:
        return groups[0].page_size_bytes
    page = max(spec.page_size_bytes for group in groups for spec in group.layer_specs)
    group_size = max(len(group.layer_names) for group in groups)
    return page * group_size
