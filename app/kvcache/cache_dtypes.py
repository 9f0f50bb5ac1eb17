"""The latent cache's dtypes: how one token's latent ``[kv_c, k_pe]`` is stored, and the rules
that write and read it.

A token's latent is ``kv_lora_rank`` values of ``kv_c`` (the key's latent part, which is also
the value) followed by ``qk_rope_head_dim`` values of ``k_pe`` (the shared rope key). The cache
dtypes are named as vLLM names them (``--kv-cache-dtype``, ``CacheConfig.kv_cache_dtype``):

- ``auto``: the model's dtype, ``kv_lora_rank + qk_rope_head_dim`` values per token (1,152
  bytes at DeepSeek's 512 + 64 in bf16).
- ``fp8`` / ``fp8_e4m3`` (two names, one layout): every value in float8 e4m3 (``e4m3fn``),
  one float32 scale per layer, ``value = e4m3 * scale`` (576 bytes per token): what the GPU
  backends (FLASHINFER_MLA, TOKENSPEED_MLA) read, with the scale passed per call (``k_scale``).
- ``fp8_ds_mla``: DeepSeek's own row (FlashMLA's FP8 KV cache, vLLM's ``fp8_ds_mla``), bytes:
  ``[0, R)`` the ``R = kv_lora_rank`` latent values in e4m3; ``[R, R + 4 R / 128)`` one float32
  scale per 128 latent values (little-endian, tile ``t`` covering values ``[128 t, 128 t +
  128)``), ``value = e4m3 * scale``; then the ``qk_rope_head_dim`` rope values in bf16. At
  DeepSeek's dims: 512 + 16 + 128 = **656 bytes per token**, stored as a ``uint8`` cache
  ``[num_blocks, block_size, 656]``. A cache vLLM writes is read here, and ours by FlashMLA.

**Writing** (a token's latent is quantised once, when it enters the cache):

- ``fp8_ds_mla``: each tile's scale is the smallest power of two ``>= amax / 448`` over the
  tile's *finite* values (``amax`` 0: ``2^-126``, vLLM's floor). A power of two, so that
  ``e4m3 * scale`` is exact in bf16 and float32 (a reader that dequantises into bf16 adds no
  rounding) and FlashMLA's DeepSeek-V3.2 kernels, which assume power-of-two scales, read it;
  the tile's largest value lands in (224, 448], with e4m3's relative precision (2^-4) for every
  normal value. vLLM's own writer uses ``amax / 448``: a reader must not assume a power of
  two, and ours does not.
- ``fp8`` / ``fp8_e4m3``: one scale per layer, fixed before the first token is written. The
  rule must not clip a later token silently, so the engine derives it from the model
  (``app.model.MLAAttention.latent_bound``: ``kv_c`` is RMS-normalised, so no value exceeds
  ``sqrt(kv_lora_rank) * max|kv_a_layernorm|``; ``k_pe`` is a rotation of a projection of an
  RMS-normalised input, bounded by the projection's row norms), then rounds ``bound / 448`` up
  to a power of two. Every finite value the layer can produce then fits. A value that does not
  anyway (a scale given by someone else) is saturated to +-448 and counted
  (``quantize_fp8_per_layer`` returns the count; the engine warns and reports it).
- **NaN and inf**: e4m3fn has no infinity, and torch's cast turns an infinity into a finite
  +-448. Here every non-finite value (NaN, +-inf) becomes the e4m3 NaN (``0x7F``), so it stays
  non-finite: the query rows that see that key come out NaN, as with a bf16 cache (the
  kernels' rule). A tile's scale is taken over its finite values, so the other values of a
  tile holding a NaN keep their precision. In ``fp8_ds_mla`` the rope part is bf16 and keeps
  its inf or NaN as it is.

**Reading**: ``dequantize_*`` give the values back in float32 (exact: ``e4m3 * 2^k`` and bf16
are exact in float32), or in any float dtype.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from app.config import KV_CACHE_DTYPES, parse_kv_cache_dtype

__all__ = [
    "DS_MLA_TILE",
    "FP8_E4M3_MAX",
    "KV_CACHE_DTYPES",
    "LatentCacheFormat",
    "canonical_kv_cache_dtype",
    "dequantize_fp8_ds_mla",
    "dequantize_fp8_per_layer",
    "ds_mla_row_bytes",
    "ds_mla_scales",
    "fp8_power_of_two_scale",
    "quantize_fp8_ds_mla",
    "quantize_fp8_per_layer",
]

#: The largest finite float8 e4m3fn value.
FP8_E4M3_MAX = 448.0
#: Latent values per float32 scale in an ``fp8_ds_mla`` row.
DS_MLA_TILE = 128
#: The smallest scale a writer stores (float32's smallest normal, 2^-126: vLLM's floor too).
_MIN_EXPONENT, _MAX_EXPONENT = -126, 127


def canonical_kv_cache_dtype(value: object) -> str:
    """``"auto"``, ``"fp8_e4m3"`` (for ``"fp8"`` too) or ``"fp8_ds_mla"`` (see
    ``app.config.parse_kv_cache_dtype`` for what is accepted)."""
    name = parse_kv_cache_dtype(value)
    return "fp8_e4m3" if name == "fp8" else name


def ds_mla_row_bytes(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one ``fp8_ds_mla`` row: ``R`` e4m3 values, ``R / 128`` float32 scales and the
    rope values in bf16 (656 at 512 + 64). ``ValueError`` unless ``R`` is a positive multiple
    of 128 and the rope dim is >= 0."""
    if not (isinstance(kv_lora_rank, int) and kv_lora_rank > 0
            and kv_lora_rank % DS_MLA_TILE == 0):
        raise ValueError(f"fp8_ds_mla: kv_lora_rank must be a positive multiple of "
                         f"{DS_MLA_TILE} (one scale per {DS_MLA_TILE} latent values), got "
                         f"{kv_lora_rank!r}")
    if not (isinstance(qk_rope_head_dim, int) and qk_rope_head_dim >= 0):
        raise ValueError(f"fp8_ds_mla: qk_rope_head_dim must be an int >= 0, got "
                         f"{qk_rope_head_dim!r}")
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_TILE) + 2 * qk_rope_head_dim


def fp8_power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= amax / 448`` (float32, elementwise), within
    ``[2^-126, 2^127]``; ``amax`` 0 (or NaN) gives ``2^-126``. Exact (``frexp``, no ``log2``
    rounding): every finite ``|x| <= amax`` then satisfies ``|x| / scale <= 448``."""
    need = amax.to(torch.float32) / FP8_E4M3_MAX
    mantissa, exponent = torch.frexp(need)           # need = mantissa * 2^exponent
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(need > 0, exponent, torch.full_like(exponent, _MIN_EXPONENT))
    exponent = exponent.clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    return torch.ldexp(torch.ones_like(need), exponent.to(torch.float32))


def _to_e4m3(scaled: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``scaled`` (float32, finite values within +-448 or saturated to them) as e4m3fn, every
    non-finite element as the e4m3 NaN (torch would turn an inf into 448)."""
    clamped = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return torch.where(finite, clamped, torch.full_like(clamped, float("nan"))).to(
        torch.float8_e4m3fn)


def quantize_fp8_ds_mla(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """``latent [..., R + rope]`` (any float dtype) as ``fp8_ds_mla`` rows ``[..., row_bytes]``
    uint8 (see the module docstring: power-of-two tile scales over finite values, non-finite
    latent values -> NaN, the rope part in bf16)."""
    if not isinstance(latent, torch.Tensor) or not latent.dtype.is_floating_point:
        raise TypeError(f"quantize_fp8_ds_mla: expected a floating tensor, got "
                        f"{getattr(latent, 'dtype', type(latent).__name__)}")
    rope = int(latent.shape[-1]) - kv_lora_rank
    ds_mla_row_bytes(kv_lora_rank, rope)             # checks the dims
    lead = tuple(latent.shape[:-1])
    tiles = kv_lora_rank // DS_MLA_TILE
    nope = latent[..., :kv_lora_rank].to(torch.float32).reshape(*lead, tiles, DS_MLA_TILE)
    finite = torch.isfinite(nope)
    amax = torch.where(finite, nope.abs(), torch.zeros_like(nope)).amax(dim=-1)
    scales = fp8_power_of_two_scale(amax)                                  # [..., tiles]
    q8 = _to_e4m3(nope / scales.unsqueeze(-1), finite).reshape(*lead, kv_lora_rank)
    pieces = [q8.view(torch.uint8), scales.contiguous().view(torch.uint8).reshape(*lead, -1)]
    if rope:
        pieces.append(latent[..., kv_lora_rank:].to(torch.bfloat16).contiguous()
                      .view(torch.uint8).reshape(*lead, 2 * rope))
    return torch.cat(pieces, dim=-1)


def _check_rows(what: str, rows: torch.Tensor, kv_lora_rank: int, rope: int) -> int:
    width = ds_mla_row_bytes(kv_lora_rank, rope)
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() < 1 \
            or int(rows.shape[-1]) != width:
        raise ValueError(f"{what}: expected uint8 fp8_ds_mla rows [..., {width}] "
                         f"(kv_lora_rank {kv_lora_rank}, rope {rope}), got "
                         f"{getattr(rows, 'dtype', type(rows).__name__)} "
                         f"{list(getattr(rows, 'shape', []))}")
    return width


def ds_mla_scales(rows: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int
                  ) -> torch.Tensor:
    """The float32 tile scales ``[..., R / 128]`` of ``fp8_ds_mla`` rows."""
    _check_rows("ds_mla_scales", rows, kv_lora_rank, qk_rope_head_dim)
    tiles = kv_lora_rank // DS_MLA_TILE
    raw = rows[..., kv_lora_rank:kv_lora_rank + 4 * tiles].contiguous()
    return raw.view(torch.float32)


def dequantize_fp8_ds_mla(rows: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8_ds_mla`` rows ``[..., row_bytes]`` -> the latent ``[..., R + rope]`` in ``dtype``:
    ``e4m3 * scale`` for the latent part (computed in float32, where it is exact for any
    scale of a power of two), the rope part as stored (bf16)."""
    _check_rows("dequantize_fp8_ds_mla", rows, kv_lora_rank, qk_rope_head_dim)
    lead = tuple(rows.shape[:-1])
    tiles = kv_lora_rank // DS_MLA_TILE
    nope = rows[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = ds_mla_scales(rows, kv_lora_rank, qk_rope_head_dim)
    values = (nope.reshape(*lead, tiles, DS_MLA_TILE) * scales.unsqueeze(-1)).reshape(
        *lead, kv_lora_rank)
    if qk_rope_head_dim:
        start = kv_lora_rank + 4 * tiles
        rope = rows[..., start:].contiguous().view(torch.bfloat16).to(torch.float32)
        values = torch.cat([values, rope], dim=-1)
    return values.to(dtype)


def quantize_fp8_per_layer(latent: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latent / scale as e4m3fn, how many finite values overflowed)``: the ``fp8`` /
    ``fp8_e4m3`` write with a layer's ``scale``. A finite value beyond ``448 * scale`` is
    saturated to +-448 and counted (the count is a 0-d int64 tensor on the latent's device:
    reading it is the caller's sync to choose); a non-finite one becomes the e4m3 NaN."""
    if not isinstance(latent, torch.Tensor) or not latent.dtype.is_floating_point:
        raise TypeError(f"quantize_fp8_per_layer: expected a floating tensor, got "
                        f"{getattr(latent, 'dtype', type(latent).__name__)}")
    scaled = latent.to(torch.float32) / float(scale)
    finite = torch.isfinite(scaled)
    overflow = (finite & (scaled.abs() > FP8_E4M3_MAX)).sum()
    return _to_e4m3(scaled, finite), overflow


def dequantize_fp8_per_layer(values: torch.Tensor, scale: float,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e4m3 * scale`` in ``dtype`` (computed in float32)."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_fp8_per_layer: expected a float8_e4m3fn tensor, got "
                         f"{getattr(values, 'dtype', type(values).__name__)}")
    return (values.to(torch.float32) * float(scale)).to(dtype)


@attrs.frozen
class LatentCacheFormat:
    """One layer's latent cache layout: the cache dtype's canonical ``name`` (``"auto"``,
    ``"fp8_e4m3"``, ``"fp8_ds_mla"``), the model's ``dtype`` (what the values are read back
    in) and the latent dims. ``from_name`` builds one from any accepted name."""

    name: str
    dtype: torch.dtype
    kv_lora_rank: int
    qk_rope_head_dim: int

    def __attrs_post_init__(self) -> None:
        if self.name not in ("auto", "fp8_e4m3", "fp8_ds_mla"):
            raise ValueError(f"LatentCacheFormat.name: expected 'auto', 'fp8_e4m3' or "
                             f"'fp8_ds_mla' (canonical_kv_cache_dtype), got {self.name!r}")
        if self.name == "fp8_ds_mla":
            ds_mla_row_bytes(self.kv_lora_rank, self.qk_rope_head_dim)

    @classmethod
    def from_name(cls, name: object, dtype: torch.dtype, kv_lora_rank: int,
                  qk_rope_head_dim: int) -> LatentCacheFormat:
        """The format of cache dtype ``name`` (any of ``KV_CACHE_DTYPES``) for a model."""
        return cls(canonical_kv_cache_dtype(name), dtype, kv_lora_rank, qk_rope_head_dim)

    @property
    def latent_dim(self) -> int:
        """Values per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def quantized(self) -> bool:
        """Whether the values are stored in FP8 (and read back dequantised)."""
        return self.name != "auto"

    @property
    def per_layer_scale(self) -> bool:
        """Whether a layer's values share one scale (``fp8_e4m3``), given per call."""
        return self.name == "fp8_e4m3"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype: the model dtype, float8_e4m3fn or uint8."""
        return {"auto": self.dtype, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_ds_mla": torch.uint8}[self.name]

    @property
    def row_width(self) -> int:
        """The cache tensor's last dim: the latent dim, or the ``fp8_ds_mla`` row's bytes."""
        if self.name == "fp8_ds_mla":
            return ds_mla_row_bytes(self.kv_lora_rank, self.qk_rope_head_dim)
        return self.latent_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer's cache (656 for fp8_ds_mla at 512 + 64)."""
        return self.row_width * self.storage_dtype.itemsize

    def encode(self, latent: torch.Tensor, scale: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rows to store, overflow count or None)`` of ``latent [..., latent_dim]``:
        ``scale`` is the layer's (``fp8_e4m3`` only)."""
        if self.name == "fp8_ds_mla":
            return quantize_fp8_ds_mla(latent, self.kv_lora_rank), None
        if self.name == "fp8_e4m3":
            return quantize_fp8_per_layer(latent, scale)
        return latent.to(self.dtype), None

    def decode(self, rows: torch.Tensor, scale: float = 1.0,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored ``rows [..., row_width]`` -> the latent ``[..., latent_dim]`` in ``dtype``
        (default: the model's)."""
        out = self.dtype if dtype is None else dtype
        if self.name == "fp8_ds_mla":
            return dequantize_fp8_ds_mla(rows, self.kv_lora_rank, self.qk_rope_head_dim, out)
        if self.name == "fp8_e4m3":
            return dequantize_fp8_per_layer(rows, scale, out)
        return rows.to(out)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly description (name, storage dtype, bytes per token)."""
        return {"kv_cache_dtype": self.name,
                "storage_dtype": str(self.storage_dtype).removeprefix("torch."),
                "bytes_per_token": self.bytes_per_token}
