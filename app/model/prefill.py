"""The chunked-prefill step of one MLA layer over a paged latent cache.

For a batch of requests, each with ``num_context_tokens`` already in the cache (an earlier step
of a chunked prefill, or a prefix-cache hit) and ``num_new_tokens`` to compute now:

1. project the new tokens (``q``, latent), write their latent into their cache slots;
2. new tokens -> causal attention through the backend (``run_prefill_new_tokens``), with LSE
   when any request of the batch has context;
3. cached context -> packed into chunks of at most ``context_chunk_tokens`` tokens (over the
   whole batch), each gathered from the cache into a workspace (an FP8 cache's rows
   dequantised to the model dtype there; the new tokens of step 2 attend over their exact
   latent, as vLLM's prefill does), up-projected to ``k``/``v``, run
   with ``run_prefill_context_chunk`` and merged by LSE into an accumulator;
4. the final merge of context and new tokens, then ``W_o``.

The backend instance is built once by the caller; it gets ``prepare_metadata`` once per step.
Planning is the same for both kinds: a free function (``plan_prefill_step`` here,
``plan_decode_step`` in ``app.model.decode``) makes the step's plan from the batch, the
executor's ``plan`` calls it with its cache's block size and device, and the plan carries the
backend's metadata (``plan.metadata``: what ``prepare_metadata`` takes).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from app._validation import check_int_at_least
from app.backends.merge import merge_attn_states
from app.backends.prefill.base import MLAPrefillBackend, MLAPrefillMetadata
from app.model.attention import MLAAttention
from app.model.cache import PagedLatentCache, slot_indices
from app.model.profiling import NULL_TIMER, PhaseTimer

__all__ = ["MLAPrefillExecutor", "PrefillPlan", "PrefillSlice", "StepPlan",
           "plan_context_chunks", "plan_prefill_step"]


@attrs.frozen
class PrefillSlice:
    """One request's share of a step: its block table (int64 block ids on the cache's device),
    the tokens already cached and the tokens computed now (positions continue the context)."""

    block_table: torch.Tensor
    num_context_tokens: int
    num_new_tokens: int


def plan_context_chunks(context_lens: Sequence[int], chunk_tokens: int
                        ) -> list[list[tuple[int, int]]]:
    """Pack the batch's cached context into chunks of at most ``chunk_tokens`` tokens.

    Returns, per chunk, one ``(start, end)`` token span per request (empty spans allowed).
    Requests are packed in order and a request's context may straddle chunks, so the number of
    chunks is the minimum, ``ceil(sum(context_lens) / chunk_tokens)``.
    """
    check_int_at_least("chunk_tokens", chunk_tokens, 1)
    chunks: list[list[tuple[int, int]]] = []
    room = 0
    for b, n in enumerate(context_lens):
        pos = 0
        while pos < n:
            if room == 0:
                chunks.append([(0, 0)] * len(context_lens))
                room = chunk_tokens
            take = min(n - pos, room)
            chunks[-1][b] = (pos, pos + take)
            pos += take
            room -= take
    return chunks


@attrs.frozen
class PrefillPlan:
    """Everything about a prefill step that does not depend on the hidden states, shared by
    every layer: ``metadata`` (what the prefill backend's ``prepare_metadata`` takes), the new
    tokens' positions and cache slots, each context chunk's cache slots."""

    metadata: MLAPrefillMetadata
    positions: torch.Tensor
    max_position: int
    new_slots: torch.Tensor
    chunk_slots: tuple[torch.Tensor, ...]
    num_context_tokens: int


def plan_prefill_step(batch: Sequence[PrefillSlice], *, block_size: int,
                      context_chunk_tokens: int, device: torch.device) -> PrefillPlan:
    """The plan of one prefill step (host work, once per step): slots, positions, context
    chunks of at most ``context_chunk_tokens`` tokens and the backend's ``MLAPrefillMetadata``.
    ``ValueError`` when a request has no new token or a negative context."""
    bs = block_size
    query_lens = [s.num_new_tokens for s in batch]
    context_lens = [s.num_context_tokens for s in batch]
    if any(n < 1 for n in query_lens) or any(n < 0 for n in context_lens):
        raise ValueError(f"every request needs >= 1 new token and >= 0 context tokens, got "
                         f"new={query_lens}, context={context_lens}")
    positions = torch.cat([torch.arange(s.num_context_tokens,
                                        s.num_context_tokens + s.num_new_tokens,
                                        dtype=torch.int64, device=device) for s in batch])
    new_slots = torch.cat([slot_indices(s.block_table, s.num_context_tokens,
                                        s.num_context_tokens + s.num_new_tokens, bs)
                           for s in batch])
    spans = plan_context_chunks(context_lens, context_chunk_tokens)
    chunk_slots = tuple(
        torch.cat([slot_indices(s.block_table, a, e, bs)
                   for s, (a, e) in zip(batch, chunk, strict=True)])
        for chunk in spans)
    metadata = MLAPrefillMetadata.build(
        query_lens, [[e - a for a, e in chunk] for chunk in spans], device=device)
    return PrefillPlan(metadata=metadata, positions=positions,
                       max_position=max(c + n for c, n in zip(context_lens, query_lens,
                                                              strict=True)) - 1,
                       new_slots=new_slots, chunk_slots=chunk_slots,
                       num_context_tokens=sum(context_lens))


#: The prefill plan's old name.
StepPlan = PrefillPlan


class MLAPrefillExecutor:
    """Runs prefill steps of one layer: the layer's projections, the cache, the backend.

    ``context_chunk_tokens`` bounds the context tokens gathered and up-projected at once (the
    workspace: ``context_chunk_tokens`` latent rows, and their keys and values).
    """

    def __init__(self, layer: MLAAttention, cache: PagedLatentCache, backend: MLAPrefillBackend,
                 context_chunk_tokens: int, timer: PhaseTimer | None = None) -> None:
        if cache.latent_dim != layer.latent_dim:
            raise ValueError(f"cache latent dim {cache.latent_dim} != layer latent dim "
                             f"{layer.latent_dim} (kv_lora_rank + qk_rope_head_dim)")
        if cache.dtype != layer.dtype or cache.device != layer.device:
            raise ValueError(f"cache ({cache.dtype}, {cache.device}) and layer "
                             f"({layer.dtype}, {layer.device}) must agree on dtype and device")
        if backend.num_heads != layer.num_heads or backend.qk_head_dim != layer.qk_head_dim \
                or backend.v_head_dim != layer.v_head_dim:
            raise ValueError(f"backend {backend!r} does not match the layer's heads/head dims "
                             f"({layer.num_heads}, {layer.qk_head_dim}, {layer.v_head_dim})")
        check_int_at_least("context_chunk_tokens", context_chunk_tokens, 1)
        self.layer = layer
        self.cache = cache
        self.backend = backend
        self.context_chunk_tokens = context_chunk_tokens
        self.timer = timer if timer is not None else NULL_TIMER
        self._workspace = torch.empty(0, layer.latent_dim, dtype=layer.dtype, device=layer.device)

    def plan(self, batch: Sequence[PrefillSlice]) -> PrefillPlan:
        """The step's plan (``plan_prefill_step`` with this layer's cache and chunk size)."""
        return plan_prefill_step(batch, block_size=self.cache.block_size,
                                 context_chunk_tokens=self.context_chunk_tokens,
                                 device=self.cache.device)

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        n = slots.shape[0]
        if self._workspace.shape[0] < n:
            self._workspace = torch.empty(n, self.layer.latent_dim, dtype=self.layer.dtype,
                                          device=self.layer.device)
        return self.cache.gather(slots, out=self._workspace)

    def forward(self, x: torch.Tensor, batch: Sequence[PrefillSlice]) -> torch.Tensor:
        """One step: ``x [T, hidden]`` are the new tokens of ``batch`` in order (request by
        request). Returns the layer output ``[T, hidden]`` in the model dtype."""
        timer = self.timer
        with timer.phase("metadata"):
            plan = self.plan(batch)
            if x.dim() != 2 or x.shape[0] != plan.metadata.total_q:
                raise ValueError(f"x must be [{plan.metadata.total_q}, hidden], "
                                 f"got {list(x.shape)}")
            self.backend.prepare_metadata(plan.metadata)
        return self.run_planned(x, plan)

    def run_planned(self, x: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
        """``forward`` after ``plan`` and ``prepare_metadata`` (the layer part of a step; an
        engine with several layers plans once and runs this per layer)."""
        timer, layer, backend = self.timer, self.layer, self.backend
        with timer.phase("projection"):
            q, latent = layer.project(x, plan.positions, plan.max_position)
        with timer.phase("cache_write"):
            self.cache.write(plan.new_slots, latent)
        with timer.phase("up_projection"):
            k, v = layer.up_project(latent)
        has_context = plan.num_context_tokens > 0
        with timer.phase("attention_new"):
            result = backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=has_context)
        if not has_context:
            attn = result if isinstance(result, torch.Tensor) else result[0]
        else:
            if not isinstance(result, tuple):
                raise TypeError(f"{type(backend).__name__}.run_prefill_new_tokens returned no "
                                f"LSE although return_softmax_lse=True")
            new_out, new_lse = result
            del k, v
            ctx_out: torch.Tensor | None = None
            ctx_lse: torch.Tensor | None = None
            for i, slots in enumerate(plan.chunk_slots):
                with timer.phase("gather"):
                    ctx_latent = self._gather(slots)
                with timer.phase("up_projection"):
                    ck, cv = layer.up_project(ctx_latent)
                with timer.phase("attention_context"):
                    out_i, lse_i = backend.run_prefill_context_chunk(i, q, ck, cv)
                del ck, cv
                if ctx_out is None or ctx_lse is None:
                    ctx_out, ctx_lse = out_i, lse_i
                else:
                    with timer.phase("merge"):
                        ctx_out, ctx_lse = merge_attn_states(ctx_out, ctx_lse, out_i, lse_i)
            if ctx_out is None or ctx_lse is None:  # pragma: no cover - has_context => chunks
                raise RuntimeError("context tokens but no context chunk")
            with timer.phase("merge"):
                attn, _ = merge_attn_states(ctx_out, ctx_lse, new_out, new_lse, out=new_out)
        with timer.phase("projection"):
            return layer.output(attn)
