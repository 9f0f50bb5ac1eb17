"""What one token of a KV-cache spec takes, in words, and how many model layers a set of specs
is, for ``run`` and ``kv-plan``.

An ``fp8_ds_mla`` spec says ``head_size`` 576 and ``dtype`` uint8, but its row is 656 bytes
(512 e4m3 values, 4 float32 scales, 64 bf16 rope values): printing the fields would print
``576 uint8``. And a sparse model's indexer keys are a spec of their own beside each latent
layer's: a 61-layer DeepSeek-V3.2 has 122 specs, not 122 layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Spec types that belong to a layer another spec already counts (the indexer's key cache of
#: an attention layer).
AUXILIARY_SPECS = ("IndexerKeyCacheSpec",)

_SHORT_DTYPES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    return _SHORT_DTYPES.get(name, name)


def token_row(spec: Any) -> dict[str, Any] | None:
    """One token's row of ``spec`` in one layer: ``bytes`` (padding excluded) and ``layout``
    (e.g. ``"512 e4m3 + 4 float32 scales + 64 bfloat16 rope"``); None for a spec with no
    per-token row (a Mamba state)."""
    from app.kvcache.cache_dtypes import DS_MLA_TILE, ds_mla_row_bytes

    head_size, block_size = getattr(spec, "head_size", None), getattr(spec, "block_size", None)
    if head_size is None or not block_size:
        return None
    if getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla":
        rope = 64 if spec.qk_rope_head_dim is None else spec.qk_rope_head_dim
        rank = head_size - rope
        return {"bytes": ds_mla_row_bytes(rank, rope),
                "layout": f"{rank} e4m3 + {rank // DS_MLA_TILE} float32 scales + {rope} "
                          f"bfloat16 rope"}
    heads = getattr(spec, "num_kv_heads", 1)
    values = f"{head_size} {_dtype_name(spec.dtype)}"
    layout = values if heads == 1 else f"{heads} heads x {values}"
    size = getattr(spec, "real_page_size_bytes", spec.page_size_bytes) // block_size
    if size == 2 * heads * head_size * spec.dtype.itemsize:    # a key and a value per token
        layout = f"K and V, each {layout}"
    return {"bytes": size, "layout": layout}


def row_text(row: Mapping[str, Any] | None) -> str:
    """``"656 B (512 e4m3 + 4 float32 scales + 64 bfloat16 rope)"``; ``"-"`` for no row."""
    return "-" if row is None else f"{row['bytes']} B ({row['layout']})"


def count_layers(specs_by_type: Mapping[str, int]) -> int:
    """Model layers among specs counted by type name: every spec but the auxiliary ones."""
    return sum(n for name, n in specs_by_type.items() if name not in AUXILIARY_SPECS)
