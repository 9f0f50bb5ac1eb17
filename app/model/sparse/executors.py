"""The sparse MLA layer of DeepSeek-V3.2 / GLM-5 on the engine's paged caches, prefill and decode.

A sparse layer runs MLA in the absorbed form for both kinds of step (as DeepSeek's own kernels
do): per layer of a planned step,

1. project the new tokens (``q``, latent and the q LoRA's residual), write their latent into
   the latent cache;
2. the layer's indexer (``LayerIndexer``; absent on a GLM-5 ``shared`` layer): index queries,
   keys and weights; the keys into the layer's key cache (the same slots: one block table for
   both caches); ``SparseIndexer.select`` keeps each row's top ``index_topk`` visible positions
   and ``SparseIndexerMetadata.to_slots`` turns them into latent-cache slots. A shared layer
   reuses the previous layer's slots (``SparseSelection``, one per step);
3. fold ``W_UK`` into the query, attend over the selected latent rows through the backend's
   sparse verb (``run_sparse_prefill`` over the cache viewed flat, ``run_sparse_decode`` over the
   paged cache), apply ``W_UV`` and ``W_o``.

The plans are the dense ones with the indexer's per-step layout added (``SparsePrefillPlan``,
``SparseDecodePlan``: ``plan_sparse_prefill`` / ``plan_sparse_decode``), made once per step and
shared by every layer. No ``[T, T]`` matrix is made: the indexer scores a bounded block of rows
at a time and the attention reads ``index_topk`` rows per query. No tensor is ``index_topk``
wide either: a step's selection is ``min(index_topk, the most keys a row of the step sees)``
wide (``SparseIndexer.select``), so a config's ``index_topk`` never sizes memory past what the
step's context can use.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.backends.sparse.indexer import SparseIndexer, SparseIndexerMetadata
from app.model.attention import MLAAttention
from app.model.cache import PagedLatentCache
from app.model.decode import DecodePlan
from app.model.prefill import PrefillPlan, PrefillSlice
from app.model.profiling import NULL_TIMER, PhaseTimer
from app.model.sparse.layer import LayerIndexer
from app.model.sparse.selections import pack_positions

__all__ = ["SparseDecodePlan", "SparseMLAExecutor", "SparsePrefillPlan", "SparseSelection",
           "plan_sparse_decode", "plan_sparse_prefill"]


@attrs.frozen
class SparsePrefillPlan(PrefillPlan):
    """A prefill plan with the indexer's layout of the step (``indexer``)."""

    indexer: SparseIndexerMetadata


@attrs.frozen(eq=False)
class SparseDecodePlan(DecodePlan):
    """A decode plan with the indexer's layout of the step (``indexer``)."""

    indexer: SparseIndexerMetadata = attrs.field(kw_only=True)


def plan_sparse_prefill(batch: Sequence[PrefillSlice], plan: PrefillPlan) -> SparsePrefillPlan:
    """``plan`` (the step's dense plan over ``batch``) with the indexer's layout: each request's
    block table (padded into ``[B, W]`` int32) and each new token's visible count (its context
    and itself)."""
    width = max((int(s.block_table.numel()) for s in batch), default=1)
    device = plan.positions.device
    table = torch.zeros(len(batch), max(width, 1), dtype=torch.int32, device=device)
    for b, s in enumerate(batch):
        table[b, :s.block_table.numel()] = s.block_table
    visible = [s.num_context_tokens + j + 1 for s in batch for j in range(s.num_new_tokens)]
    meta = SparseIndexerMetadata.build(table, [s.num_new_tokens for s in batch], visible,
                                       device=device, what="plan_sparse_prefill")
    fields = {f.name: getattr(plan, f.name) for f in attrs.fields(PrefillPlan)}
    return SparsePrefillPlan(**fields, indexer=meta)


def plan_sparse_decode(plan: DecodePlan) -> SparseDecodePlan:
    """``plan`` with the indexer's layout: the step's block table, and row ``i`` of each request
    seeing its cached tokens and the step's first ``i + 1`` (positions + 1)."""
    meta = SparseIndexerMetadata.build(
        plan.block_table, [plan.query_len] * plan.batch, (plan.positions + 1).tolist(),
        device=plan.block_table.device, what="plan_sparse_decode")
    fields = {f.name: getattr(plan, f.name) for f in attrs.fields(DecodePlan) if f.init}
    return SparseDecodePlan(**fields, indexer=meta)


class SparseSelection:
    """One step's latest selection (latent-cache slots ``[T, min(index_topk, the step's most
    visible keys)]`` int32, ``-1`` padding): a GLM-5 ``shared`` layer attends to the rows the
    layer before it selected. ``record``: also keep every indexer layer's selection (``chosen``,
    in layer order, each ``[T, ceil(the step's most visible keys / 8)]`` uint8 bitmasks,
    ``app.model.sparse.selections``: no ``index_topk``-wide copy), for a check that feeds the
    engine's own selection to the float64 reference."""

    def __init__(self, record: bool = False) -> None:
        self.slots: torch.Tensor | None = None
        self.chosen: list[torch.Tensor] | None = [] if record else None


class SparseMLAExecutor:
    """One sparse layer (see the module docstring): its MLA projections and latent cache, its
    indexer and key cache (None on a shared layer), the indexer's scorer and the backends
    (shared by every layer; the caller prepares them once per step)."""

    def __init__(self, layer: MLAAttention, cache: PagedLatentCache, *,
                 indexer: LayerIndexer | None, key_cache: PagedLatentCache | None,
                 selector: SparseIndexer, index_topk: int, prefill_backend: MLAPrefillBackend,
                 decode_backend: MLADecodeBackend, timer: PhaseTimer | None = None) -> None:
        if (indexer is None) != (key_cache is None):
            raise ValueError("a sparse layer has both an indexer and its key cache, or neither")
        for kind, backend in (("prefill", prefill_backend), ("decode", decode_backend)):
            if not backend.supports_sparse or backend.num_heads != layer.num_heads \
                    or backend.kv_lora_rank != layer.kv_lora_rank \
                    or backend.qk_rope_head_dim != layer.qk_rope_head_dim:
                raise ValueError(f"the {kind} backend {backend!r} must run sparse attention "
                                 f"(supports_sparse) with the layer's heads and latent dims "
                                 f"({layer.num_heads}, {layer.kv_lora_rank}, "
                                 f"{layer.qk_rope_head_dim})")
        if cache.latent_dim != layer.latent_dim or cache.dtype != layer.dtype:
            raise ValueError(f"latent cache ({cache.latent_dim}, {cache.dtype}) does not match "
                             f"the layer ({layer.latent_dim}, {layer.dtype})")
        self.layer, self.cache = layer, cache
        self.indexer, self.key_cache = indexer, key_cache
        self.selector, self.index_topk = selector, index_topk
        self.prefill_backend, self.decode_backend = prefill_backend, decode_backend
        self.timer = timer if timer is not None else NULL_TIMER

    def _select(self, x: torch.Tensor, q_resid: torch.Tensor | None, positions: torch.Tensor,
                max_position: int, slots: torch.Tensor, meta: SparseIndexerMetadata,
                selection: SparseSelection) -> torch.Tensor:
        """This layer's selection as latent-cache slots (its own, or the previous layer's)."""
        if self.indexer is None or self.key_cache is None:
            if selection.slots is None:
                raise ValueError("a shared sparse layer needs the selection of a layer before "
                                 "it in the same step")
            return selection.slots
        if q_resid is None:  # pragma: no cover - sparse configs require a q LoRA
            raise ValueError("the indexer reads the q LoRA residual; this layer has none")
        with self.timer.phase("indexer"):
            iq, ik, weights = self.indexer.project(x, q_resid, positions, max_position)
            self.key_cache.write(slots, ik)
            chosen = self.selector.select(iq, weights, self.key_cache.data, meta,
                                          self.index_topk)
            if selection.chosen is not None:
                selection.chosen.append(pack_positions(chosen, max(meta.seq_lens, default=1)))
            selection.slots = meta.to_slots(chosen, self.cache.block_size)
        return selection.slots

    def _project(self, x: torch.Tensor, positions: torch.Tensor, max_position: int,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.timer.phase("projection"):
            q, latent, q_resid = self.layer.project_with_residual(x, positions, max_position)
        with self.timer.phase("cache_write"):
            self.cache.write(slots, latent)
        return q, q_resid

    def _prefill_rows(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the sparse prefill verb reads: the latent cache viewed flat with ``chosen``
        slots, or for an FP8 cache the rows ``chosen`` names, dequantised once (as the dense
        prefill dequantises the context it gathers), with ``chosen`` renumbered into them."""
        if not self.cache.format.quantized:
            return self.cache.data.view(-1, self.layer.latent_dim), chosen
        named = chosen >= 0
        slots, order = torch.unique(chosen[named].to(torch.int64), return_inverse=True)
        local = torch.full_like(chosen, -1)
        local[named] = order.to(chosen.dtype)
        return self.cache.gather(slots), local

    def run_prefill(self, x: torch.Tensor, plan: SparsePrefillPlan,
                    selection: SparseSelection) -> torch.Tensor:
        """One layer of a planned prefill step: ``x [T, hidden]`` -> ``[T, hidden]``."""
        layer = self.layer
        q, q_resid = self._project(x, plan.positions, plan.max_position, plan.new_slots)
        chosen = self._select(x, q_resid, plan.positions, plan.max_position, plan.new_slots,
                              plan.indexer, selection)
        with self.timer.phase("absorption"):
            q_abs = layer.absorb_query(q)
        with self.timer.phase("attention_sparse"):
            kv, chosen = self._prefill_rows(chosen)
            out = self.prefill_backend.run_sparse_prefill(q_abs, kv, chosen)
        if not isinstance(out, torch.Tensor):  # pragma: no cover - no LSE was asked for
            raise TypeError("run_sparse_prefill returned a tuple without return_softmax_lse")
        with self.timer.phase("absorption"):
            attn = layer.unabsorb_output(out)
        with self.timer.phase("projection"):
            return layer.output(attn)

    def run_decode(self, x: torch.Tensor, plan: SparseDecodePlan,
                   selection: SparseSelection) -> torch.Tensor:
        """One layer of a planned decode step: ``x [B * query_len, hidden]`` (request-major)
        -> ``[B * query_len, hidden]``."""
        layer = self.layer
        q, q_resid = self._project(x, plan.positions, plan.max_position, plan.slots)
        chosen = self._select(x, q_resid, plan.positions, plan.max_position, plan.slots,
                              plan.indexer, selection)
        b, n = plan.batch, plan.query_len
        with self.timer.phase("absorption"):
            q_abs = layer.absorb_query(q).view(b, n, layer.num_heads, layer.latent_dim)
        with self.timer.phase("attention_sparse"):
            out = self.decode_backend.run_sparse_decode(
                q_abs, self.cache.data, chosen.view(b, n, -1),
                k_scale=self.cache.k_scale if self.cache.format.per_layer_scale else None)
        if not isinstance(out, torch.Tensor):  # pragma: no cover - no LSE was asked for
            raise TypeError("run_sparse_decode returned a tuple without return_softmax_lse")
        with self.timer.phase("absorption"):
            attn = layer.unabsorb_output(out.view(b * n, layer.num_heads, layer.kv_lora_rank))
        with self.timer.phase("projection"):
            return layer.output(attn)
