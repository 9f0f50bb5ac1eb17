"""KV-cache specs: what one attention layer needs from the paged KV cache.

Every spec is an ``attrs`` class: frozen, keyword-only and hashable, so equal layers compare equal
and specs can key dicts. ``page_size_bytes`` is the memory of one block of ``block_size`` tokens for
one layer; ``max_memory_usage_bytes(max_model_len)`` is the most one request can hold for that
layer. ``is_uniform_with_collection(specs)`` says whether a set of layers can share one KV-cache
group under this spec's rule (the first spec's rule applies), as the bindings in effect see it:
those ``uniformity_bindings(bindings)`` puts in effect (grouping does, with the bindings it is
given), else the active container's (the seed API installs that default); ``bindings=`` passes
them explicitly.

Page sizes:

- K+V attention (full, sliding window, chunked local, cross, sink):
  ``2 * block_size * num_kv_heads * head_size * dtype_size``.
- MLA (and sliding-window MLA, hidden states): one latent vector per token,
  ``block_size * num_kv_heads * head_size * dtype_size`` with ``num_kv_heads = 1`` and
  ``head_size = kv_lora_rank + qk_rope_head_dim`` (DeepSeek: 512 + 64 = 576); an MLA spec with
  ``cache_dtype_str = "fp8_ds_mla"`` stores one FlashMLA row per token instead (656 bytes at
  DeepSeek's dims; ``app.kvcache.cache_dtypes``).
- TurboQuant full attention: ``block_size * num_kv_heads * tq_slot_size`` (the slot holds the
  quantized K and V of one token and head).
- Mamba: the state tensors, ``sum(prod(shape) * dtype_size)``, whatever the block size.

``page_size_padded`` (attention and Mamba specs) raises a page to a larger size so that layers of
different kinds can share one block pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import torch

from app._validation import check_int, is_int
from app.config import DTYPE_ALIASES, parse_kv_cache_dtype
from app.kvcache.cache_dtypes import ds_mla_row_bytes

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "HiddenStateCacheSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "TQFullAttentionSpec",
    "UniformBaseLookup",
    "cdiv",
    "default_uniformity_lookup",
    "set_default_uniformity_lookup",
    "to_kv_dtype",
    "uniformity_bindings",
]

#: dtype names accepted by spec ``dtype`` fields, beyond the engine's compute dtypes.
KV_DTYPE_ALIASES: dict[str, torch.dtype] = {
    **DTYPE_ALIASES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def to_kv_dtype(value: object) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or a name (``"bf16"``, ``"fp8"``, ``"float32"``, ...)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in KV_DTYPE_ALIASES:
            return KV_DTYPE_ALIASES[key]
        raise ValueError(f"unknown KV-cache dtype {value!r}; allowed: "
                         f"{', '.join(sorted(KV_DTYPE_ALIASES))}")
    raise TypeError(f"expected a torch.dtype or a dtype name, got {value!r} "
                    f"({type(value).__name__})")


def _to_dtypes(value: object) -> tuple[torch.dtype, ...]:
    if isinstance(value, (torch.dtype, str)):
        return (to_kv_dtype(value),)
    if isinstance(value, Iterable):
        return tuple(to_kv_dtype(v) for v in value)
    raise TypeError(f"expected dtypes (a sequence of dtypes or names), got {value!r}")


def _to_shapes(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        raise TypeError(f"expected shapes (a sequence of int sequences), got {value!r}")
    shapes = []
    for shape in value:
        if not isinstance(shape, Iterable) or isinstance(shape, (str, bytes)):
            raise TypeError(f"expected each shape to be a sequence of ints, got {shape!r}")
        dims = tuple(shape)
        for dim in dims:
            if not is_int(dim) or dim < 1:
                raise ValueError(f"shape dimensions must be ints >= 1, got {dims!r}")
        shapes.append(dims)
    return tuple(shapes)


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not is_int(value):
        raise TypeError(f"{type(instance).__name__}.{attribute.name}: expected an int >= 1, "
                        f"got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{type(instance).__name__}.{attribute.name}: expected an int >= 1, "
                         f"got {value!r}")


def _optional_positive(instance: object, attribute: attrs.Attribute[Any],
                       value: object) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _check_lengths(spec: KVCacheSpec, max_model_len: object,
                   max_num_batched_tokens: object = None,
                   max_num_encoder_tokens: object = None) -> None:
    """``TypeError`` / ``ValueError`` unless ``max_model_len`` is an int >= 1 and the optional
    step and encoder sizes are None or ints (>= 1 and >= 0)."""
    what = f"{type(spec).__name__}.max_memory_usage_bytes"
    check_int(f"{what}: max_model_len", max_model_len, 1)
    if max_num_batched_tokens is not None:
        check_int(f"{what}: max_num_batched_tokens", max_num_batched_tokens, 1)
    if max_num_encoder_tokens is not None:
        check_int(f"{what}: max_num_encoder_tokens", max_num_encoder_tokens, 0)


def _values(specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec]) -> list[KVCacheSpec]:
    if isinstance(specs, Mapping):
        return list(specs.values())
    return list(specs)


class UniformBaseLookup(Protocol):
    """What the uniformity check needs: the uniform base spec bound to a spec's type
    (``KVCacheSpecBindings`` provides it)."""

    def get_uniform_type_base_spec(self, kv_cache_spec: KVCacheSpec
                                   ) -> type[KVCacheSpec] | None: ...


_bindings_in_effect: contextvars.ContextVar[UniformBaseLookup | None] = contextvars.ContextVar(
    "app_uniformity_bindings", default=None)
_default_lookup: list[Callable[[], UniformBaseLookup]] = []


@contextlib.contextmanager
def uniformity_bindings(bindings: UniformBaseLookup) -> Iterator[UniformBaseLookup]:
    """Inside the block (this thread or task), ``is_uniform_with_collection(specs)`` called
    without bindings uses ``bindings``: how grouping calls vLLM's one-argument form, which a
    third-party spec may override with exactly that signature."""
    token = _bindings_in_effect.set(bindings)
    try:
        yield bindings
    finally:
        _bindings_in_effect.reset(token)


def set_default_uniformity_lookup(lookup: Callable[[], UniformBaseLookup]) -> None:
    """What ``is_uniform_with_collection(specs)`` asks outside ``uniformity_bindings``: the seed
    API (``app.kvcache.seed_api``) installs the active container's bindings here."""
    _default_lookup[:] = [lookup]


def default_uniformity_lookup() -> UniformBaseLookup | None:
    """The bindings a call without any uses: those ``uniformity_bindings`` puts in effect, else
    the default the seed API installs (the active container's), else None."""
    in_effect = _bindings_in_effect.get()
    if in_effect is not None:
        return in_effect
    return _default_lookup[0]() if _default_lookup else None


def _uniformity_lookup() -> UniformBaseLookup:
    found = default_uniformity_lookup()
    if found is None:
        raise ValueError("is_uniform_with_collection: no KV-cache spec bindings in effect; "
                         "pass bindings= or call it inside uniformity_bindings(bindings)")
    return found


@attrs.frozen(kw_only=True)
class KVCacheSpec:
    """The KV-cache format of one layer: ``block_size`` tokens per block.

    Subclasses define ``page_size_bytes`` and ``max_memory_usage_bytes``; register a new kind
    with ``@register_kv_cache_spec(manager_class=..., uniform_type_base_spec=...)``.
    """

    block_size: int = attrs.field(validator=_positive)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (``block_size`` tokens) of this layer's cache."""
        raise NotImplementedError(f"{type(self).__name__} does not define page_size_bytes")

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        """The most cache memory one request of ``max_model_len`` tokens holds in this layer.

        ``max_num_batched_tokens`` (the most tokens scheduled in one step) matters only to
        specs that free blocks as a request advances (sliding window, chunked local).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not define max_memory_usage_bytes")

    def max_num_blocks_per_request(self, max_model_len: int, *,
                                   max_num_batched_tokens: int | None = None) -> int:
        """``max_memory_usage_bytes`` in blocks of this spec's page size."""
        _check_lengths(self, max_model_len, max_num_batched_tokens)
        return cdiv(self.max_memory_usage_bytes(
            max_model_len, max_num_batched_tokens=max_num_batched_tokens), self.page_size_bytes)

    def is_uniform_with_collection(
            self, kv_cache_specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec],
            bindings: UniformBaseLookup | None = None) -> bool:
        """Whether every spec in ``kv_cache_specs`` can share a KV-cache group under my rule.

        The base rule: each spec is an instance of my uniform base spec as the bindings (a
        container's ``KVCacheSpecBindings``: ``bindings``, else those in effect, see the module
        docstring) register it. ``ValueError`` when my type is not registered there.
        """
        if bindings is None:
            bindings = _uniformity_lookup()
        base = bindings.get_uniform_type_base_spec(self)
        if base is None:
            raise ValueError(
                f"Unsupported KV cache spec type: {type(self).__module__}."
                f"{type(self).__qualname__}. Register it with @register_kv_cache_spec("
                "manager_class=...) or KVCacheSpecRegistry.register(...).")
        return all(isinstance(spec, base) for spec in _values(kv_cache_specs))

    def _same_block_size_and(self, specs: list[KVCacheSpec], field: str) -> bool:
        """Every spec has this spec's block size and this spec's value of ``field``."""
        mine = getattr(self, field)
        return all(spec.block_size == self.block_size and getattr(spec, field, None) == mine
                   for spec in specs)

    def copy_with(self, **changes: Any) -> KVCacheSpec:
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)


@attrs.frozen(kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Attention with separate K and V per token: ``num_kv_heads`` heads of ``head_size``."""

    num_kv_heads: int = attrs.field(validator=_positive)
    head_size: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field(converter=to_kv_dtype)
    #: Pad each page to this many bytes (``None``: no padding).
    page_size_padded: int | None = attrs.field(default=None, validator=_optional_positive)

    def __attrs_post_init__(self) -> None:
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(f"{type(self).__name__}.page_size_padded: {self.page_size_padded} "
                             f"is smaller than the real page size {self.real_page_size_bytes}")

    @property
    def real_page_size_bytes(self) -> int:
        """The page size before padding: ``2 * block_size * num_kv_heads * head_size * size``."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """The page size, padded when ``page_size_padded`` is set."""
        padded = self.page_size_padded
        return self.real_page_size_bytes if padded is None else padded

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        """Every token of the request keeps its slot: ``cdiv(max_model_len, bs)`` pages."""
        _check_lengths(self, max_model_len, max_num_batched_tokens)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over every earlier token: blocks are held until the request ends."""


def _cache_dtype_str(value: object) -> str | None:
    """vLLM's ``cache_dtype_str``: None, or a name of ``app.config.KV_CACHE_DTYPES``."""
    if value is None:
        return None
    return parse_kv_cache_dtype(value, "MLAAttentionSpec.cache_dtype_str")


#: DeepSeek's rope dims: what an ``fp8_ds_mla`` spec assumes when it is not told (vLLM's 656).
_DS_MLA_DEFAULT_ROPE = 64


@attrs.frozen(kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent "head" per token, no separate V.

    ``head_size`` is ``kv_lora_rank + qk_rope_head_dim`` (DeepSeek: 576); build one from the
    model's dimensions with ``MLAAttentionSpec.from_dims`` or ``from_model_config``.
    ``cache_dtype_str`` (vLLM's field) names the cache dtype (``app.config.KV_CACHE_DTYPES``;
    None: ``dtype`` says all): with ``"fp8_ds_mla"`` a token takes one FlashMLA row
    (``app.kvcache.cache_dtypes``: 656 bytes at 512 + 64; ``dtype`` is then the row's
    ``uint8``), for which ``qk_rope_head_dim`` (default 64) splits ``head_size``.
    """

    num_kv_heads: int = attrs.field(default=1, validator=_positive)
    cache_dtype_str: str | None = attrs.field(default=None, converter=_cache_dtype_str)
    qk_rope_head_dim: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(0))))

    def __attrs_post_init__(self) -> None:
        if self.cache_dtype_str == "fp8_ds_mla":
            ds_mla_row_bytes(*self._ds_mla_dims())   # a ValueError for dims it cannot hold
        super().__attrs_post_init__()

    def _ds_mla_dims(self) -> tuple[int, int]:
        rope = _DS_MLA_DEFAULT_ROPE if self.qk_rope_head_dim is None else self.qk_rope_head_dim
        return self.head_size - rope, rope

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * head_size * dtype_size`` (one vector per token); for
        ``fp8_ds_mla``, ``block_size * num_kv_heads`` FlashMLA rows (656 bytes each at
        512 + 64)."""
        if self.cache_dtype_str == "fp8_ds_mla":
            return self.block_size * self.num_kv_heads * ds_mla_row_bytes(*self._ds_mla_dims())
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer (padding excluded): 1152 for 576 values in bf16,
        576 in fp8, 656 in fp8_ds_mla."""
        return self.real_page_size_bytes // self.block_size

    @classmethod
    def from_dims(cls, *, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
                  dtype: torch.dtype | str, kv_cache_dtype: str | None = None
                  ) -> MLAAttentionSpec:
        """The spec of a latent cache of ``kv_lora_rank + qk_rope_head_dim`` per token;
        ``kv_cache_dtype`` (``"auto"``/None: ``dtype``; ``"fp8"``, ``"fp8_e4m3"``,
        ``"fp8_ds_mla"``) stores it in FP8 (``app.kvcache.cache_dtypes``)."""
        name = None if kv_cache_dtype is None else _cache_dtype_str(kv_cache_dtype)
        if name in (None, "auto"):
            return cls(block_size=block_size, head_size=kv_lora_rank + qk_rope_head_dim,
                       dtype=to_kv_dtype(dtype))
        storage = torch.uint8 if name == "fp8_ds_mla" else torch.float8_e4m3fn
        return cls(block_size=block_size, head_size=kv_lora_rank + qk_rope_head_dim,
                   dtype=storage, cache_dtype_str=name, qk_rope_head_dim=qk_rope_head_dim)

    @classmethod
    def from_model_config(cls, model_config: Any, *, block_size: int,
                          dtype: torch.dtype | str | None = None,
                          kv_cache_dtype: str | None = None) -> MLAAttentionSpec:
        """The spec for an ``app.config.ModelConfig`` (its dtype unless ``dtype`` is given;
        ``kv_cache_dtype`` as ``from_dims``)."""
        return cls.from_dims(block_size=block_size, kv_lora_rank=model_config.kv_lora_rank,
                             qk_rope_head_dim=model_config.qk_rope_head_dim,
                             dtype=model_config.dtype if dtype is None else dtype,
                             kv_cache_dtype=kv_cache_dtype)


@attrs.frozen(kw_only=True)
class TQFullAttentionSpec(FullAttentionSpec):
    """Full attention with a quantized slot layout: ``tq_slot_size`` bytes per token and head.

    The slot holds that token's quantized K and V (and their scales); ``dtype`` is the compute
    dtype and does not enter the page size.
    """

    tq_slot_size: int = attrs.field(validator=_positive)

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * tq_slot_size``."""
        return self.block_size * self.num_kv_heads * self.tq_slot_size


@attrs.frozen(kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Hidden states cached per token (speculative-decoding drafters read them back).

    One vector of ``head_size`` (the hidden size) per token; grouped with full attention.
    """


@attrs.frozen(kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` static sink tokens shared by every request.

    The sink tokens live in blocks the manager reserves once (``sink_len`` must be a multiple of
    ``block_size``); each request's own blocks follow them in its block table.
    """

    sink_len: int = attrs.field(validator=_positive)


def _window_tokens(span: int, max_model_len: int, max_num_batched_tokens: int | None) -> int:
    in_flight = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    return min(span + in_flight, max_model_len)


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens; older blocks are freed."""

    sliding_window: int = attrs.field(validator=_positive)

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        """The window (``sliding_window - 1`` tokens) plus one step's new tokens, plus one block
        because the window need not start on a block boundary; never more than the full length.
        """
        _check_lengths(self, max_model_len, max_num_batched_tokens)
        tokens = _window_tokens(self.sliding_window - 1, max_model_len, max_num_batched_tokens)
        blocks = min(cdiv(tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))
        return blocks * self.page_size_bytes

    def is_uniform_with_collection(
            self, kv_cache_specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec],
            bindings: UniformBaseLookup | None = None) -> bool:
        """The base rule, plus an equal ``sliding_window`` and an equal block size."""
        specs = _values(kv_cache_specs)
        return (super().is_uniform_with_collection(specs, bindings)
                and self._same_block_size_and(specs, "sliding_window"))


@attrs.frozen(kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention over an MLA latent cache (one vector per token)."""

    num_kv_heads: int = attrs.field(default=1, validator=_positive)

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * head_size * dtype_size``."""
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@attrs.frozen(kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4 local layers).

    Blocks of earlier chunks are freed once the request moves into a new chunk.
    """

    attention_chunk_size: int = attrs.field(validator=_positive)

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        """One chunk plus one step's new tokens (never more than the full length)."""
        _check_lengths(self, max_model_len, max_num_batched_tokens)
        tokens = _window_tokens(self.attention_chunk_size, max_model_len,
                                max_num_batched_tokens)
        return cdiv(tokens, self.block_size) * self.page_size_bytes

    def is_uniform_with_collection(
            self, kv_cache_specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec],
            bindings: UniformBaseLookup | None = None) -> bool:
        """The base rule, plus an equal ``attention_chunk_size`` and an equal block size."""
        specs = _values(kv_cache_specs)
        return (super().is_uniform_with_collection(specs, bindings)
                and self._same_block_size_and(specs, "attention_chunk_size"))


@attrs.frozen(kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder cross-attention over the encoder's output (encoder-decoder models).

    Blocks hold the encoder tokens once per request; they are never prefix-cached.
    """

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None,
                               max_num_encoder_tokens: int | None = None) -> int:
        """Pages for the encoder's tokens (``max_num_encoder_tokens``, default the model len)."""
        _check_lengths(self, max_model_len, max_num_batched_tokens,
                       max_num_encoder_tokens)
        tokens = max_model_len if max_num_encoder_tokens is None else max_num_encoder_tokens
        return cdiv(tokens, self.block_size) * self.page_size_bytes


@attrs.frozen(kw_only=True)
class MambaSpec(KVCacheSpec):
    """A state-space (Mamba) layer: a constant-size state instead of per-token K/V.

    ``shapes`` and ``dtypes`` describe the state tensors of one request (conv state, SSM
    state). ``block_size`` is the token distance between cacheable state checkpoints.
    """

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_to_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_to_dtypes)
    page_size_padded: int | None = attrs.field(default=None, validator=_optional_positive)

    def __attrs_post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("MambaSpec.shapes: expected at least one state shape")
        if len(self.dtypes) != len(self.shapes):
            raise ValueError(f"MambaSpec: {len(self.shapes)} shapes but {len(self.dtypes)} "
                             "dtypes; give one dtype per state tensor")
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(f"MambaSpec.page_size_padded: {self.page_size_padded} is smaller "
                             f"than the real page size {self.real_page_size_bytes}")

    @property
    def real_page_size_bytes(self) -> int:
        """``sum(prod(shape) * dtype_size)`` over the state tensors."""
        return sum(math.prod(shape) * dtype.itemsize
                   for shape, dtype in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        """The state's size, padded when ``page_size_padded`` is set."""
        padded = self.page_size_padded
        return self.real_page_size_bytes if padded is None else padded

    def max_memory_usage_bytes(self, max_model_len: int, *,
                               max_num_batched_tokens: int | None = None) -> int:
        """Two pages: the state read at the start of a step and the one written at its end."""
        _check_lengths(self, max_model_len, max_num_batched_tokens)
        return 2 * self.page_size_bytes

    def is_uniform_with_collection(
            self, kv_cache_specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec],
            bindings: UniformBaseLookup | None = None) -> bool:
        """The base rule, plus equal state ``shapes`` and an equal block size."""
        specs = _values(kv_cache_specs)
        return (super().is_uniform_with_collection(specs, bindings)
                and self._same_block_size_and(specs, "shapes"))


def spec_summary(spec: KVCacheSpec) -> dict[str, Any]:
    """A JSON-friendly description of ``spec``: its type and fields (dtypes as names)."""
    out: dict[str, Any] = {"type": type(spec).__name__}
    for field in attrs.fields(type(spec)):
        value = getattr(spec, field.name)
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        elif isinstance(value, tuple) and value and isinstance(value[0], torch.dtype):
            value = [str(v).removeprefix("torch.") for v in value]
        elif isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        out[field.name] = value
    return out
