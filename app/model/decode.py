"""The decode step of MLA layers in the absorbed form, over the paged latent cache.

For a batch of ``B`` requests, each with ``num_computed`` tokens in the cache and the same
``query_len`` new tokens (1, or 1 + k speculative drafts):

1. ``plan_decode_step`` (host work, once per step; the executor's ``plan`` calls it with its
   cache's block size and device): positions, the new tokens' cache slots, the int32 block
   table ``[B, max_blocks]`` and ``seq_lens`` ``[B]`` (counting the new tokens), checked into
   the ``MLADecodeMetadata`` the decode backend's ``prepare_metadata`` takes
   (``plan.metadata``); the caller hands it to the backend once, as prefill's plan does;
2. per layer (``MLADecodeExecutor.run_planned``): project the new tokens (``q``, latent), write
   their latent into their slots (quantised once there, for an FP8 cache: the backend reads
   the stored rows, with the layer's scale for ``fp8``), fold ``W_UK`` into the query's nope part
   (``MLAAttention.absorb_query``: ``[T, H, kv_lora_rank + rope]``), attend over the latent cache
   through the decode backend (``[B, query_len, H, kv_lora_rank]``), apply ``W_UV``
   (``unabsorb_output``) and ``W_o``.

No key or value is ever up-projected: that is why engines decode in this form.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from app._cpu import copy_to_device
from app._validation import check_int_at_least
from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.model.attention import MLAAttention
from app.model.cache import PagedLatentCache
from app.model.profiling import NULL_TIMER, PhaseTimer

__all__ = ["DecodePlan", "MLADecodeExecutor", "plan_decode_step"]


@attrs.frozen(eq=False)
class DecodePlan:
    """A decode step's layout, shared by every layer.

    ``block_table`` int32 ``[B, max_blocks]`` and ``seq_lens`` int32 ``[B]``, checked into
    ``metadata`` (what the decode backend's ``prepare_metadata`` takes; built from them when
    not given), ``positions`` and ``slots`` int64 ``[B * query_len]`` (request-major),
    ``max_position`` their host-side maximum, ``slot_bounds`` the host-side ``(min, max)`` of
    ``slots`` (None: not known on the host; the cache then reads them from the device).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    max_position: int
    query_len: int
    metadata: MLADecodeMetadata = attrs.field(default=None)
    slot_bounds: tuple[int, int] | None = None

    def __attrs_post_init__(self) -> None:
        if self.metadata is None:
            object.__setattr__(self, "metadata", MLADecodeMetadata.build(
                self.block_table, self.seq_lens, self.query_len, what="plan_decode_step"))

    @property
    def batch(self) -> int:
        """Requests in the step."""
        return int(self.block_table.shape[0])


def plan_decode_step(block_tables: Sequence[torch.Tensor], num_computed: Sequence[int],
                     query_len: int, block_size: int, device: torch.device, *,
                     pad_to: int | None = None) -> DecodePlan:
    """The plan of one decode step.

    ``block_tables[b]`` is request ``b``'s int32 block ids (at least enough for
    ``num_computed[b] + query_len`` tokens; extra entries are ignored), ``num_computed[b]`` its
    cached tokens. ``ValueError`` when a table is too short or the lengths disagree.

    ``pad_to``: a batch size ``>= len(block_tables)`` the step is padded to (the same shapes
    for every batch up to it, what a captured CUDA graph replays): each padding request has
    ``query_len`` tokens in block 0 (the pool's reserved block: written and read there, never
    a request's), its rows come after the real ones and mean nothing.

    Everything is computed on the host and reaches ``device`` by asynchronous copies from
    pinned memory (``app._cpu.copy_to_device``): planning never waits for the device, and
    nothing is read back from it.
    """
    if len(block_tables) != len(num_computed):
        raise ValueError(f"plan_decode_step: {len(block_tables)} block tables for "
                         f"{len(num_computed)} requests")
    if query_len < 1:
        raise ValueError(f"plan_decode_step: query_len must be >= 1, got {query_len}")
    if pad_to is not None:
        check_int_at_least("plan_decode_step: pad_to", pad_to, len(block_tables))
        null = torch.zeros(-(-query_len // block_size), dtype=torch.int32)
        block_tables = [*block_tables, *[null] * (pad_to - len(block_tables))]
        num_computed = [*num_computed, *[0] * (pad_to - len(num_computed))]
    ends = [n + query_len for n in num_computed]
    widths = [-(-e // block_size) for e in ends]
    for b, (table, width) in enumerate(zip(block_tables, widths, strict=True)):
        if table.numel() < width:
            raise ValueError(f"plan_decode_step: request {b} needs {width} blocks for "
                             f"{ends[b]} tokens, its table has {table.numel()}")
    max_blocks = max(widths, default=1)
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for b, (t, width) in enumerate(zip(block_tables, widths, strict=True)):
        table[b, :width] = t[:width]
    start = torch.tensor(num_computed, dtype=torch.int64)
    positions = (start[:, None] + torch.arange(query_len, dtype=torch.int64)).reshape(-1)
    rows = torch.arange(len(block_tables), dtype=torch.int64).repeat_interleave(query_len)
    slots = table[rows, positions // block_size].to(torch.int64) * block_size \
        + positions % block_size
    metadata = MLADecodeMetadata.build(table, torch.tensor(ends, dtype=torch.int32),
                                       query_len, what="plan_decode_step", device=device)
    both = copy_to_device(torch.stack([positions, slots]), device)   # one copy for the two
    bounds = (int(slots.min()), int(slots.max())) if slots.numel() else None
    return DecodePlan(block_table=metadata.block_table, seq_lens=metadata.seq_lens,
                      positions=both[0], slots=both[1], max_position=max(ends, default=1) - 1,
                      query_len=query_len, metadata=metadata, slot_bounds=bounds)


class MLADecodeExecutor:
    """Runs decode steps of one layer in the absorbed form: the layer, its cache, the decode
    backend (shared by every layer; the caller runs ``prepare_metadata`` once per step)."""

    def __init__(self, layer: MLAAttention, cache: PagedLatentCache, backend: MLADecodeBackend,
                 timer: PhaseTimer | None = None) -> None:
        if cache.latent_dim != layer.latent_dim or cache.dtype != layer.dtype \
                or cache.device != layer.device:
            raise ValueError(f"cache ({cache.latent_dim}, {cache.dtype}, {cache.device}) and "
                             f"layer ({layer.latent_dim}, {layer.dtype}, {layer.device}) must "
                             "agree on latent dim, dtype and device")
        if backend.num_heads != layer.num_heads or backend.kv_lora_rank != layer.kv_lora_rank \
                or backend.qk_rope_head_dim != layer.qk_rope_head_dim:
            raise ValueError(f"decode backend {backend!r} does not match the layer's heads / "
                             f"latent dims ({layer.num_heads}, {layer.kv_lora_rank}, "
                             f"{layer.qk_rope_head_dim})")
        if getattr(backend, "kv_cache_dtype", cache.data.dtype) != cache.data.dtype or \
                getattr(backend, "kv_cache_format", "auto") != cache.format.name:
            raise ValueError(f"decode backend {backend!r} reads {backend.kv_cache_dtype} "
                             f"caches, the layer's cache is {cache.format.name} "
                             f"({cache.data.dtype}): build the backend for the config's "
                             f"cache.kv_cache_dtype")
        self.layer = layer
        self.cache = cache
        self.backend = backend
        self.timer = timer if timer is not None else NULL_TIMER

    def plan(self, block_tables: Sequence[torch.Tensor], num_computed: Sequence[int],
             query_len: int) -> DecodePlan:
        """The step's plan (``plan_decode_step`` with this layer's cache)."""
        return plan_decode_step(block_tables, num_computed, query_len, self.cache.block_size,
                                self.cache.device)

    def run_planned(self, x: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """One layer of a planned step: ``x [B * query_len, hidden]`` (request-major) ->
        the layer output ``[B * query_len, hidden]`` in the model dtype."""
        timer, layer = self.timer, self.layer
        if x.dim() != 2 or x.shape[0] != plan.slots.shape[0]:
            raise ValueError(f"x must be [{plan.slots.shape[0]}, hidden], got {list(x.shape)}")
        with timer.phase("projection"):
            q, latent = layer.project(x, plan.positions, plan.max_position)
        with timer.phase("cache_write"):
            self.cache.write(plan.slots, latent, bounds=plan.slot_bounds)
        with timer.phase("absorption"):
            q_abs = layer.absorb_query(q)
        b, n = plan.batch, plan.query_len
        with timer.phase("attention_decode"):
            out = self.backend.run_decode(
                q_abs.view(b, n, layer.num_heads, layer.latent_dim), self.cache.data,
                k_scale=self.cache.k_scale if self.cache.format.per_layer_scale else None)
        if not isinstance(out, torch.Tensor):  # pragma: no cover - no LSE was asked for
            raise TypeError(f"{type(self.backend).__name__}.run_decode returned a tuple "
                            "although return_softmax_lse=False")
        with timer.phase("absorption"):
            attn = layer.unabsorb_output(out.view(b * n, layer.num_heads, layer.kv_lora_rank))
        with timer.phase("projection"):
            return layer.output(attn)
