"""The paged latent KV cache of one MLA layer group.

Storage is one tensor ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``: one latent
vector (``kv_c`` then ``k_pe``) per token, as ``MLAAttentionSpec`` pages it. Which block holds
which request's tokens is decided by the ``KVCacheManager``; this class only moves data: it
writes new tokens into their slots and gathers a request's cached context by its block table.

With an FP8 cache dtype (``kv_cache_dtype``: ``fp8`` / ``fp8_e4m3``, ``fp8_ds_mla``; the
layouts and rules are ``app.kvcache.cache_dtypes``') a token's latent is quantised once, when
it is written (prefill, decode and speculative tokens alike), and ``gather`` dequantises what it
reads into the model dtype (the prefill path's context chunks); the decode backends read the
stored rows themselves. ``fp8`` keeps one scale per layer (``k_scale``), fixed when the cache
is made; a finite value beyond it is saturated and counted in ``overflow`` (the engine derives
the scale from the model so that this cannot happen, and warns if it does).

A *slot* is ``block_id * block_size + offset``; token ``i`` of a request lives in slot
``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from app._cpu import physical_memory_bytes
from app._validation import check_int_at_least
from app.kvcache.cache_dtypes import LatentCacheFormat

if TYPE_CHECKING:
    from app.config import EngineConfig

__all__ = ["PagedLatentCache", "available_memory_bytes", "check_cache_fits", "slot_indices"]

#: Host memory one block costs beyond its latent storage (the pool's Python block object).
_BLOCK_OVERHEAD_BYTES = 256


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory the KV cache may take on ``device``: free GPU memory, or the host's physical
    memory; None when it cannot be told (no CUDA here, an OS without ``sysconf``)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return physical_memory_bytes()


def check_cache_fits(config: EngineConfig, device: torch.device, num_layers: int = 1, *,
                     bytes_per_block: int | None = None) -> None:
    """``ValueError`` when ``cache.num_blocks`` blocks cannot fit in memory: the latent cache of
    ``num_layers`` layers on ``device`` (or ``bytes_per_block``, every cache of a block: what
    the KV-cache groups say, a sparse model's key caches included), the pool's per-block
    bookkeeping on the host. Checked before the pool is built (a huge ``num_blocks`` would
    otherwise spend minutes building it, then fail, or, as the cache's allocation is lazy,
    bring the OOM killer once its blocks are used); ``MLAEngine`` runs it before it builds
    anything."""
    model, cache = config.model, config.cache
    per_token = LatentCacheFormat.from_name(cache.kv_cache_dtype, model.dtype, model.kv_lora_rank,
                                            model.qk_rope_head_dim).bytes_per_token
    latent = num_layers * cache.block_size * per_token if bytes_per_block is None \
        else bytes_per_block
    cpu = torch.device("cpu")
    per_block = ({device: latent, cpu: _BLOCK_OVERHEAD_BYTES} if device.type != "cpu"
                 else {cpu: latent + _BLOCK_OVERHEAD_BYTES})
    for where, cost in per_block.items():
        have = available_memory_bytes(where)
        if have is not None and cache.num_blocks * cost > have:
            raise ValueError(
                f"cache.num_blocks = {cache.num_blocks} needs "
                f"{cache.num_blocks * cost / 2**30:.1f} GiB of {where} memory ({cost} B per "
                f"block: {latent} B of latent cache for {cache.block_size} tokens of "
                f"{num_layers} layer(s), and the "
                f"pool's bookkeeping); {where} has {have / 2**30:.1f} GiB: use at most "
                f"{have // cost} blocks (--num-blocks or [cache] num_blocks)")


def slot_indices(block_table: torch.Tensor, start: int, end: int, block_size: int
                 ) -> torch.Tensor:
    """Slots of tokens ``start:end`` of a request whose blocks are ``block_table`` (int64, on
    the cache's device). Raises ``ValueError`` when the table is too short for ``end``."""
    if not 0 <= start <= end:
        raise ValueError(f"slot_indices: need 0 <= start <= end, got {start}, {end}")
    needed = -(-end // block_size)
    if needed > block_table.numel():
        raise ValueError(f"slot_indices: tokens up to {end} need {needed} blocks of "
                         f"{block_size}, the block table has {block_table.numel()}")
    pos = torch.arange(start, end, dtype=torch.int64, device=block_table.device)
    return block_table.index_select(0, pos // block_size) * block_size + pos % block_size


class PagedLatentCache:
    """``[num_blocks, block_size, latent_dim]`` latent storage with slot writes and gathers.

    ``dtype`` is the model's (what is written and read back); ``kv_cache_dtype`` stores it in
    FP8 (see the module docstring): ``kv_lora_rank`` is then needed (``fp8_ds_mla`` splits
    each row there) and ``k_scale`` is the layer's scale (``fp8`` / ``fp8_e4m3``);
    ``overflow`` (a 0-d int64 tensor on ``device``, or a caller's view, e.g. one element of a
    per-layer counter) counts the values that scale saturated."""

    def __init__(self, num_blocks: int, block_size: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", *, kv_cache_dtype: str = "auto",
                 kv_lora_rank: int | None = None, k_scale: float = 1.0,
                 overflow: torch.Tensor | None = None) -> None:
        for name, value, minimum in (("num_blocks", num_blocks, 1),
                                     ("block_size", block_size, 1),
                                     ("latent_dim", latent_dim, 1)):
            check_int_at_least(f"PagedLatentCache: {name}", value, minimum)
        if kv_lora_rank is None:
            if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
                raise ValueError(f"PagedLatentCache: kv_cache_dtype {kv_cache_dtype!r} needs "
                                 f"kv_lora_rank (where each row's latent part ends)")
            kv_lora_rank = latent_dim
        if not 0 < kv_lora_rank <= latent_dim:
            raise ValueError(f"PagedLatentCache: kv_lora_rank must be in [1, {latent_dim}], got "
                             f"{kv_lora_rank}")
        if not (isinstance(k_scale, (int, float)) and 0.0 < float(k_scale) < float("inf")):
            raise ValueError(f"PagedLatentCache: k_scale must be a finite number > 0, got "
                             f"{k_scale!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.latent_dim = latent_dim
        self.dtype = dtype
        self.device = torch.device(device)
        #: The layout (``app.kvcache.cache_dtypes.LatentCacheFormat``).
        self.format = LatentCacheFormat.from_name(kv_cache_dtype, dtype, kv_lora_rank,
                                                  latent_dim - kv_lora_rank)
        #: The layer's scale (``fp8`` / ``fp8_e4m3``; 1 for the other dtypes).
        self.k_scale = float(k_scale) if self.format.per_layer_scale else 1.0
        self.overflow = overflow if overflow is not None else torch.zeros(
            (), dtype=torch.int64, device=self.device)
        width = self.format.row_width
        self.data = torch.zeros(num_blocks, block_size, width, dtype=self.format.storage_dtype,
                                device=self.device)
        self._flat = self.data.view(num_blocks * block_size, width)
        # torch has no index_copy_ / index_select for float8: its rows move as bytes
        self._rows = self._flat.view(torch.uint8) if self.format.quantized else self._flat

    @property
    def num_slots(self) -> int:
        """Tokens the storage holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the storage tensor."""
        return self.data.numel() * self.data.element_size()

    def _check_slots(self, slots: torch.Tensor) -> None:
        if slots.dtype != torch.int64 or slots.dim() != 1 or slots.device != self.device:
            raise ValueError(f"PagedLatentCache: slots must be a 1-D int64 tensor on "
                             f"{self.device}, got {slots.dtype} {tuple(slots.shape)} on "
                             f"{slots.device}")

    def write(self, slots: torch.Tensor, latent: torch.Tensor, *,
              bounds: tuple[int, int] | None = None) -> None:
        """Store ``latent [T, latent_dim]`` at ``slots [T]``: cast to the model dtype, or
        quantised to the FP8 cache dtype (see the module docstring).

        ``bounds``: the ``(min, max)`` of ``slots`` where the caller computed them on the host
        (a decode plan does): checked instead of reading the slots back from the device."""
        self._check_slots(slots)
        if latent.dim() != 2 or latent.shape[1] != self.latent_dim or \
                latent.shape[0] != slots.shape[0]:
            raise ValueError(f"PagedLatentCache.write: expected latent [{slots.shape[0]}, "
                             f"{self.latent_dim}], got {list(latent.shape)}")
        if slots.numel():
            lo, hi = bounds if bounds is not None else (int(slots.min()), int(slots.max()))
            if lo < 0 or hi >= self.num_slots:
                raise ValueError(f"PagedLatentCache.write: slots must be in [0, "
                                 f"{self.num_slots}), got [{lo}, {hi}]")
        if not self.format.quantized:
            self._flat.index_copy_(0, slots, latent.to(self.dtype))
            return
        rows, overflow = self.format.encode(latent, self.k_scale)
        if overflow is not None:
            self.overflow += overflow
        self._rows.index_copy_(0, slots, rows.view(torch.uint8))

    def gather(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The latent vectors at ``slots [N]``: ``[N, latent_dim]`` in the model dtype (into
        ``out[:N]`` if given; an FP8 cache's rows dequantised).

        Slots come from ``slot_indices`` over block tables the manager handed out, so they are
        in range by construction; ``index_select`` still refuses an out-of-range index.
        """
        self._check_slots(slots)
        if out is None:
            rows = self._rows.index_select(0, slots)
            return self._decode(rows) if self.format.quantized else rows
        n = slots.shape[0]
        if out.dim() != 2 or out.shape[0] < n or out.shape[1] != self.latent_dim \
                or out.dtype != self.dtype:
            raise ValueError(f"PagedLatentCache.gather: out must be [>= {n}, "
                             f"{self.latent_dim}] {self.dtype}, got {list(out.shape)} "
                             f"{out.dtype}")
        if self.format.quantized:   # dequantised as it is gathered (the stored rows stay FP8)
            return out[:n].copy_(self._decode(self._rows.index_select(0, slots)))
        return torch.index_select(self._flat, 0, slots, out=out[:n])

    def _decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows (as bytes) -> the latent in the model dtype."""
        return self.format.decode(rows.view(self.format.storage_dtype), self.k_scale)

    def read_tokens(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Tokens ``start:end`` of a request with blocks ``block_ids`` (for tests and checks)."""
        table = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return self.gather(slot_indices(table, start, end, self.block_size))

    def __repr__(self) -> str:
        fmt = "" if not self.format.quantized else f", kv_cache_dtype={self.format.name!r}"
        return (f"PagedLatentCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"latent_dim={self.latent_dim}, dtype={self.dtype}{fmt})")
