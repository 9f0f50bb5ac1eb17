"""Frozen, validated engine configuration.

``EngineConfig`` holds a ``ModelConfig`` (dtype and MLA dimensions), an ``AttentionConfig`` (which
prefill / decode backend, if forced, by name) and a ``CacheConfig`` (block size, number of blocks,
prefix caching). Every field is checked when the object is built: a bad value raises ``ValueError``
(``TypeError`` for a value of the wrong type) naming the field, the value and what is allowed. Build
one in code, from a plain dict (``EngineConfig.from_dict``) or from a TOML file
(``EngineConfig.from_toml``).
"""

from __future__ import annotations

import enum
import functools
import keyword
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from app._files import load_toml
from app._types import MLADimensions
from app._validation import INT32_MAX, check_int, check_positive_finite
from app.catalog import CATALOGS

__all__ = [
    "DTYPE_ALIASES",
    "KV_CACHE_DTYPES",
    "AttentionConfig",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "dtype_name",
    "parse_dtype",
    "parse_kv_cache_dtype",
]

#: Accepted dtype names, mapped to the torch dtype they mean.
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
_CANONICAL_DTYPE_NAME = {
    torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def parse_dtype(value: object, field: str = "dtype") -> torch.dtype:
    """Turn a dtype name (``"bf16"``, ``"bfloat16"``, ...) or a ``torch.dtype`` into a torch dtype.

    Raises ``ValueError`` naming ``field`` for an unknown name or an unsupported dtype, and
    ``TypeError`` for anything that is neither a string nor a ``torch.dtype``.
    """
    allowed = ", ".join(sorted(DTYPE_ALIASES))
    if isinstance(value, torch.dtype):
        if value not in _CANONICAL_DTYPE_NAME:
            raise ValueError(f"{field}: unsupported dtype {value}; allowed: {allowed}")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in DTYPE_ALIASES:
            raise ValueError(f"{field}: unknown dtype name {value!r}; allowed: {allowed}")
        return DTYPE_ALIASES[key]
    raise TypeError(f"{field}: expected a dtype name or torch.dtype, got {value!r} "
                    f"({type(value).__name__})")


#: The latent cache's dtypes, named as vLLM names them (``--kv-cache-dtype``): ``auto`` (the
#: model's dtype), ``fp8`` / ``fp8_e4m3`` (every value in float8 e4m3 with one scale per
#: layer: what the GPU backends read) and ``fp8_ds_mla`` (DeepSeek's FlashMLA row: the latent
#: in e4m3 with a float32 scale per 128 values, the rope part in bf16; 656 bytes per token at
#: DeepSeek's dims). ``app.kvcache.cache_dtypes`` defines the layouts.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")


def parse_kv_cache_dtype(value: object, field: str = "kv_cache_dtype") -> str:
    """A cache dtype name of ``KV_CACHE_DTYPES`` (case and surrounding blanks ignored; None
    means ``"auto"``). ``ValueError`` naming ``field`` for another name, ``TypeError`` for a
    value that is not a string."""
    if value is None:
        return "auto"
    if not isinstance(value, str):
        raise TypeError(f"{field}: expected a cache dtype name ({', '.join(KV_CACHE_DTYPES)}), "
                        f"got {value!r} ({type(value).__name__})")
    name = value.strip().lower()
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"{field}: unknown cache dtype {value!r}; allowed: "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return name


def _cache_dtype(value: object) -> str:
    return parse_kv_cache_dtype(value, "CacheConfig.kv_cache_dtype")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return _CANONICAL_DTYPE_NAME[dtype]


#: Upper bounds: a head dim or rank, a head count, a hidden size. Far above any model, low
#: enough that a typo (``num_heads = 9223372036854775807``) is refused here, not deep in torch.
MAX_HEAD_DIM = 2**16
MAX_NUM_HEADS = 2**10
MAX_HIDDEN_SIZE = 2**18


def _int_in(minimum: int, maximum: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
        check_int(f"{type(instance).__name__}.{attribute.name}", value, minimum, maximum)

    return check


def _optional_int_in(minimum: int, maximum: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
        if value is not None:
            check_int(f"{type(instance).__name__}.{attribute.name} (or None)", value, minimum,
                      maximum)

    return check


def _optional_positive_float(instance: object, attribute: attrs.Attribute[float | None],
                             value: object) -> None:
    if value is None:
        return
    check_positive_finite(f"{type(instance).__name__}.{attribute.name} (or None)", value)


def _bool_field(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{type(instance).__name__}.{attribute.name}: expected true or false, "
                        f"got {value!r} ({type(value).__name__})")


def _power_of_two(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value & (value - 1):
        raise ValueError(f"{type(instance).__name__}.{attribute.name}: expected a power of two, "
                         f"got {value!r}")


def _model_dtype(value: object) -> torch.dtype:
    return parse_dtype(value, "ModelConfig.dtype")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The attention shape of an MLA model (defaults: a small DeepSeek-shaped layer).

    ``softmax_scale`` defaults to ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.

    ``index_topk`` makes the model sparse (DeepSeek Sparse Attention, as DeepSeek-V3.2 and
    GLM-5 run it): each query attends only to the ``index_topk`` cached tokens its layer's
    indexer selects; ``index_head_dim`` and ``index_n_heads`` are the indexer's key width and
    head count (read only when ``index_topk`` is set). None: a dense model.
    """

    dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=_model_dtype)
    num_heads: int = attrs.field(default=16, validator=_int_in(1, MAX_NUM_HEADS))
    hidden_size: int = attrs.field(default=2048, validator=_int_in(1, MAX_HIDDEN_SIZE))
    kv_lora_rank: int = attrs.field(default=512, validator=_int_in(1, MAX_HEAD_DIM))
    qk_nope_head_dim: int = attrs.field(default=128, validator=_int_in(1, MAX_HEAD_DIM))
    qk_rope_head_dim: int = attrs.field(default=64, validator=_int_in(0, MAX_HEAD_DIM))
    v_head_dim: int = attrs.field(default=128, validator=_int_in(1, MAX_HEAD_DIM))
    softmax_scale: float | None = attrs.field(default=None, validator=_optional_positive_float)
    index_topk: int | None = attrs.field(default=None, validator=_optional_int_in(1, INT32_MAX))
    index_head_dim: int = attrs.field(default=128, validator=_int_in(1, MAX_HEAD_DIM))
    index_n_heads: int = attrs.field(default=64, validator=_int_in(1, MAX_NUM_HEADS))

    @property
    def is_sparse(self) -> bool:
        """Whether attention is sparse (``index_topk`` is set)."""
        return self.index_topk is not None

    @property
    def qk_head_dim(self) -> int:
        """The q/k head dim of prefill attention: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale in use (explicit, or ``1 / sqrt(qk_head_dim)``)."""
        if self.softmax_scale is not None:
            return float(self.softmax_scale)
        return 1.0 / math.sqrt(self.qk_head_dim)

    @functools.cached_property
    def mla_dimensions(self) -> MLADimensions:
        """The model's MLA prefill dimensions (built once: selection reads them every time)."""
        return MLADimensions(qk_nope_head_dim=self.qk_nope_head_dim,
                             qk_rope_head_dim=self.qk_rope_head_dim,
                             v_head_dim=self.v_head_dim)


def _backend_name(kind: str, field: str, value: object) -> str | None:
    """``AttentionConfig.<field>`` as a backend's name (a string) or None.

    The config sits below the registry: it checks the name against the kind's catalog
    (``app.catalog``: the built-ins, ``CUSTOM`` and every name registered so far in
    this process; an enum member gives its name; ``"auto"``, ``""`` and None mean automatic
    selection), with vLLM's message listing the valid names. Selection checks that the name has
    a valid class in the container.
    """
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        value = value.name
    if not isinstance(value, str):
        raise TypeError(f"{field}: expected a backend name, 'auto' or None, got {value!r} "
                        f"({type(value).__name__})")
    name = value.strip()
    if name.lower() in ("", "auto"):
        return None
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise ValueError(f"{field}: expected 'auto' or a backend name (an identifier like "
                         f"'FLASHINFER', not starting with '_'), got {value!r}")
    try:
        CATALOGS[kind].resolve(name)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    return name


def _prefill_backend_name(value: object) -> str | None:
    return _backend_name("prefill", "AttentionConfig.mla_prefill_backend", value)


def _decode_backend_name(value: object) -> str | None:
    return _backend_name("decode", "AttentionConfig.mla_decode_backend", value)


@attrs.frozen(kw_only=True)
class AttentionConfig:
    """How attention runs: ``mla_prefill_backend`` / ``mla_decode_backend`` force a backend by
    name (None or "auto" = select; an unknown name is a ``ValueError`` here, listing the valid
    ones: the built-ins, ``CUSTOM`` and names registered beforehand).
    """

    mla_prefill_backend: str | None = attrs.field(default=None,
                                                  converter=_prefill_backend_name)
    mla_decode_backend: str | None = attrs.field(default=None,
                                                 converter=_decode_backend_name)
    #: Most context tokens gathered and up-projected at once in chunked prefill.
    context_chunk_tokens: int = attrs.field(default=65536, validator=_int_in(1, INT32_MAX))


@attrs.frozen(kw_only=True)
class CacheConfig:
    """The paged KV cache: tokens per block, blocks in the pool (block 0 is the null block),
    prefix caching, and the latent cache's dtype (``kv_cache_dtype``, one of
    ``KV_CACHE_DTYPES``: ``"auto"`` keeps the model's dtype)."""

    block_size: int = attrs.field(default=16, validator=[_int_in(1, MAX_HEAD_DIM),
                                                         _power_of_two])
    #: Block ids are int32; whether the blocks fit in memory is checked where the pool is built
    #: (``python -m app run`` says how much memory they need and how much there is).
    num_blocks: int = attrs.field(default=16384, validator=_int_in(2, INT32_MAX))
    enable_prefix_caching: bool = attrs.field(default=True, validator=_bool_field)
    kv_cache_dtype: str = attrs.field(default="auto", converter=_cache_dtype)


_SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "cache": CacheConfig,
}


def _build_section(name: str, cls: type[Any], raw: object) -> Any:
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise TypeError(f"EngineConfig.{name}: expected a table/dict, got {raw!r} "
                        f"({type(raw).__name__})")
    allowed = [f.name for f in attrs.fields(cls)]
    unknown = sorted(set(raw) - set(allowed), key=repr)  # keys of any type (from_dict)
    if unknown:
        raise ValueError(f"EngineConfig.{name}: unknown key(s) {unknown}; allowed: {allowed}")
    return cls(**raw)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything an engine configures: model, attention and cache."""

    model: ModelConfig = attrs.field(factory=ModelConfig)
    attention: AttentionConfig = attrs.field(factory=AttentionConfig)
    cache: CacheConfig = attrs.field(factory=CacheConfig)

    def __attrs_post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"EngineConfig.{name}: expected {cls.__name__}, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build from ``{"model": {...}, "attention": {...}, "cache": {...}}``; every key optional.

        Unknown sections or keys raise ``ValueError`` naming them and what is allowed.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"EngineConfig.from_dict: expected a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SECTIONS), key=repr)
        if unknown:
            raise ValueError(f"EngineConfig: unknown section(s) {unknown}; "
                             f"allowed: {sorted(_SECTIONS)}")
        return cls(**{name: _build_section(name, sec, data[name])
                      for name, sec in _SECTIONS.items() if name in data})

    @classmethod
    def from_toml(cls, path: str | Path) -> EngineConfig:
        """Build from a TOML file with ``[model]``, ``[attention]`` and ``[cache]`` tables."""
        return cls.from_dict(load_toml(path, "config file"))

    def to_dict(self) -> dict[str, Any]:
        """A plain, TOML/JSON-friendly dict that ``from_dict`` turns back into an equal config."""
        model = attrs.asdict(self.model)
        model["dtype"] = dtype_name(self.model.dtype)
        attention = attrs.asdict(self.attention)
        return {"model": model, "attention": attention, "cache": attrs.asdict(self.cache)}
