"""``MLADecodeSelectorConfig``: what decode selection reads (re-exported by
``app.backends.decode.base`` and ``app.backends``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from app._types import MLADimensions
from app._validation import INT32_MAX, check_int_at_least, is_int
from app.backends.decode.metadata import MAX_QUERY_LEN
from app.config import parse_kv_cache_dtype

if TYPE_CHECKING:
    from app.config import EngineConfig

__all__ = ["MLADecodeSelectorConfig"]


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    check_int_at_least(f"{type(instance).__name__}.{attribute.name}", value, 1)


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    check_int_at_least(f"{type(instance).__name__}.{attribute.name}", value, 0)


def _selector_cache_dtype(value: object) -> str:
    return parse_kv_cache_dtype(value, "MLADecodeSelectorConfig.kv_cache_dtype")


def _query_len(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not is_int(value) or not 1 <= value <= MAX_QUERY_LEN:
        raise ValueError(f"{type(instance).__name__}.query_len must be an int in "
                         f"[1, {MAX_QUERY_LEN}], got {value!r}")


def _optional_topk(instance: object, attribute: attrs.Attribute[int | None],
                   value: int | None) -> None:
    if value is not None:
        name = f"{type(instance).__name__}.{attribute.name} (or None)"
        check_int_at_least(name, value, 1)
        if value > INT32_MAX:  # ModelConfig.index_topk's range: selected positions are int32
            raise ValueError(f"{name} must be an int in [1, {INT32_MAX}], got {value!r}")


@attrs.frozen
class MLADecodeSelectorConfig:
    """What decode selection reads: the cache/compute ``dtype``, the latent dims, the number
    of query heads, the cache ``block_size``, the step's uniform ``query_len`` (1..16) and
    ``index_topk`` (the model's DeepSeek Sparse Attention top-k; None: a dense model)."""

    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))
    kv_lora_rank: int = attrs.field(validator=_positive_int)
    qk_rope_head_dim: int = attrs.field(validator=_non_negative_int)
    num_heads: int = attrs.field(validator=_positive_int)
    block_size: int = attrs.field(validator=_positive_int)
    query_len: int = attrs.field(default=1, validator=_query_len)
    #: The latent cache's dtype (``app.config.KV_CACHE_DTYPES``; ``"auto"``: ``dtype``).
    kv_cache_dtype: str = attrs.field(default="auto", converter=_selector_cache_dtype)
    index_topk: int | None = attrs.field(default=None, validator=_optional_topk)

    @property
    def sparse(self) -> bool:
        """Whether the model's attention is sparse (``index_topk`` is set)."""
        return self.index_topk is not None

    @property
    def mla_dimensions(self) -> MLADimensions:
        """The dimensions decode attention reads: ``kv_lora_rank`` and ``qk_rope_head_dim``."""
        return MLADimensions(kv_lora_rank=self.kv_lora_rank,
                             qk_rope_head_dim=self.qk_rope_head_dim)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, query_len: int = 1
                           ) -> MLADecodeSelectorConfig:
        """The selector config of an ``EngineConfig`` (model dims, cache block size)."""
        m = config.model
        return cls(dtype=m.dtype, kv_lora_rank=m.kv_lora_rank,
                   qk_rope_head_dim=m.qk_rope_head_dim, num_heads=m.num_heads,
                   block_size=config.cache.block_size, query_len=query_len,
                   kv_cache_dtype=config.cache.kv_cache_dtype,
                   index_topk=m.index_topk)
