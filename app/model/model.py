"""The whole DeepSeek-V2/V3 model on the engine's paged latent cache.

``h_0 = embed_tokens[tokens]``; per decoder layer ``h += attn(RMSNorm(h))`` then
``h += mlp(RMSNorm(h))`` (a SwiGLU MLP or the MoE); ``out = RMSNorm(h)`` and
``logits = lm_head out`` (greedy). Every layer has its own paged latent cache; all share one
block table (the layers form one KV-cache group), so block ``b`` of a request is page ``b`` of
every layer's cache.

Prefill runs the non-absorbed form through the prefill backend (``MLAPrefillExecutor``, one
per layer); decode the absorbed form through the decode backend (``MLADecodeExecutor``). A
sparse model (DeepSeek-V3.2, GLM-5: ``DeepseekConfig.indexer``) runs each layer through
``app.model.sparse.SparseMLAExecutor`` instead: a lightning indexer per layer with its own paged
key cache (the same block table), and the backends' sparse verbs over the selected rows. Both
are planned the same way, once per step: ``plan_prefill(batch)`` / ``plan_decode(block_tables,
num_computed, query_len)`` give a plan whose ``metadata`` the step hands its backend's
``prepare_metadata`` once, then every layer runs the plan. Both backend instances come from
the caller (the engine gets them from its container) and are shared by the layers. The
residual stream is held in the model dtype, as transformers holds it.

The LM head runs in the compute dtype; when that is not float32, the best candidates of each
row (``GREEDY_CANDIDATES``) are rescored in float32, so the greedy choice and its top-1 minus
top-2 margin are the float32 ones without a float32 copy of the head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import attrs
import torch

from app._cpu import copy_to_device, detect_cpu_features
from app._validation import check_int_at_least
from app.backends.decode.base import MLADecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.backends.sparse.indexer import SparseIndexer, TorchSparseIndexer
from app.config import EngineConfig
from app.model.attention import MLAAttention, fp8_cache_scale, rms_norm
from app.model.cache import PagedLatentCache
from app.model.decode import DecodePlan, MLADecodeExecutor, plan_decode_step
from app.model.linear import Linear
from app.model.moe import MoE, SwiGLU
from app.model.prefill import (
    MLAPrefillExecutor,
    PrefillPlan,
    PrefillSlice,
    plan_prefill_step,
)
from app.model.profiling import NULL_TIMER, PhaseTimer
from app.model.rope import RotaryEmbedding
from app.model.sparse.executors import (
    SparseDecodePlan,
    SparseMLAExecutor,
    SparsePrefillPlan,
    SparseSelection,
    plan_sparse_decode,
    plan_sparse_prefill,
)
from app.model.sparse.layer import LayerIndexer
from app.model.weights import ModelWeights, MoEWeights

__all__ = ["FEED_FORWARD_CHUNK", "GREEDY_CANDIDATES", "DeepseekModel", "GreedyChoice", "Watch",
           "default_compute_dtype", "layer_names"]

logger = logging.getLogger(__name__)

#: Candidates per row rescored in float32 when the LM head runs in a 16-bit dtype.
GREEDY_CANDIDATES = 8
#: Rows the feed-forward half of a layer (norm, MLP or MoE) takes at once: a long prefill step
#: runs it in chunks, so its transient memory (the MoE's per-(token, expert) rows: for 2048
#: tokens, 4 experts each, ~130 MiB at hidden 1024) stays bounded whatever the step's size.
FEED_FORWARD_CHUNK = 2048


#: A callback a forward pass shows each stage's output to: ``watch(where, tensor)`` after the
#: embedding, each layer's attention and MLP, and the final norm (``DeepseekModel.prefill`` /
#: ``decode``; ``locate_non_finite`` uses it).
Watch = Callable[[str, torch.Tensor], None]


class _NonFinite(Exception):
    """Raised by ``locate_non_finite``'s watch at the first stage whose output is not finite."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def _stop_at_non_finite(where: str, h: torch.Tensor) -> None:
    if not bool(torch.isfinite(h).all()):
        raise _NonFinite(where)


def _batch_sizes(sizes: object) -> tuple[int, ...]:
    """``sizes`` as a sorted tuple of distinct ints >= 1 (``TypeError`` / ``ValueError``)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"decode_batch_sizes must be a sequence of ints, got {sizes!r}")
    for n in sizes:
        check_int_at_least("decode_batch_sizes", n, 1)
    return tuple(sorted(set(sizes)))


def default_compute_dtype(dtype: torch.dtype, device: torch.device | str,
                          fast_low_precision: bool | None = None) -> torch.dtype:
    """The dtype projections, MLPs and the LM head run in: ``dtype``, or float32 for a 16-bit
    ``dtype`` on a device without fast 16-bit matmul (``fast_low_precision``; when None, a
    CPU's own features decide: AVX512-BF16 / AMX-BF16 for bf16, AVX512-FP16 for fp16)."""
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16):
        return dtype
    if fast_low_precision is None:
        if device.type != "cpu":
            return dtype
        features = detect_cpu_features()
        fast_low_precision = (features.fast_bfloat16 if dtype == torch.bfloat16
                              else features.fast_float16)
    return dtype if fast_low_precision else torch.float32


def layer_names(num_layers: int) -> list[str]:
    """The attention layer names of the KV-cache group: ``model.layers.{i}.self_attn``."""
    return [f"model.layers.{i}.self_attn" for i in range(num_layers)]


@attrs.frozen
class GreedyChoice:
    """Per row: the greedy token, its top-1 minus top-2 logit (float32) and its log-probability
    under the row's softmax."""

    tokens: list[int]
    margins: list[float]
    logprobs: list[float]


class DeepseekModel:
    """Embedding, decoder layers, caches, final norm and LM head on one device.

    ``weights`` must match ``config.model`` (heads, dims, softmax scale); the caches have
    ``num_blocks`` blocks of ``block_size`` tokens in the model dtype (``config.model.dtype``);
    ``compute_dtype`` is the dtype of the projections, MLPs and LM head. A sparse model also
    keeps a paged key cache per layer with an indexer (``key_caches``, ``index_head_dim`` per
    token in the model dtype) and scores it with ``indexer`` (default: ``TorchSparseIndexer``).
    ``decode_batch_sizes``: batch sizes a decode step is padded up to (``plan_decode``; the
    same shapes for every batch up to one of them, as a CUDA graph needs; default none).
    """

    def __init__(self, config: EngineConfig, weights: ModelWeights,
                 prefill_backend: MLAPrefillBackend, decode_backend: MLADecodeBackend, *,
                 num_blocks: int, block_size: int, device: torch.device,
                 compute_dtype: torch.dtype, timer: PhaseTimer | None = None,
                 decode_batch_sizes: Sequence[int] = (),
                 indexer: SparseIndexer | None = None) -> None:
        arch = weights.config
        arch.check_model_config(config.model)
        self.config = config
        self.arch = arch
        self.weights = weights
        self.device = device
        self.dtype = config.model.dtype
        self.compute_dtype = compute_dtype
        self.eps = arch.rms_norm_eps
        self.timer = timer if timer is not None else NULL_TIMER
        self.decode_batch_sizes = _batch_sizes(decode_batch_sizes)
        rope = RotaryEmbedding(arch.rope, arch.qk_rope_head_dim, compute_dtype, device,
                               interleaved=arch.rope_interleave)
        self.attention = [MLAAttention(arch, layer.attention, dtype=self.dtype,
                                       compute_dtype=compute_dtype, device=device, rope=rope)
                          for layer in weights.layers]
        self.mlps: list[SwiGLU | MoE] = [
            MoE(arch.moe, layer.mlp, compute_dtype, device)
            if isinstance(layer.mlp, MoEWeights) and arch.moe is not None
            else SwiGLU(layer.mlp, compute_dtype, device)  # type: ignore[arg-type]
            for layer in weights.layers]
        self._norms = [(layer.input_layernorm.to(device=device, dtype=self.dtype),
                        layer.post_attention_layernorm.to(device=device, dtype=self.dtype))
                       for layer in weights.layers]
        self._final_norm = weights.norm.to(device=device, dtype=self.dtype)
        self._embed = weights.embed_tokens.to(device=device, dtype=self.dtype)
        self._lm_head = weights.lm_head.to(device=device, dtype=compute_dtype)
        self._lm_head_linear = Linear(self._lm_head)
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        #: Per layer: latent values an ``fp8`` cache's scale saturated (0 by construction:
        #: ``latent_scales``); one tensor, so that the engine reads them with one sync.
        self.fp8_overflows = torch.zeros(len(self.attention), dtype=torch.int64, device=device)
        self.caches = [
            PagedLatentCache(num_blocks, block_size, attn.latent_dim, self.dtype, device,
                             kv_cache_dtype=self.kv_cache_dtype, kv_lora_rank=attn.kv_lora_rank,
                             k_scale=scale, overflow=self.fp8_overflows[i])
            for i, (attn, scale) in enumerate(zip(self.attention, self.latent_scales(),
                                                  strict=True))]
        chunk = config.attention.context_chunk_tokens
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        #: A sparse model: keep each step's selections (``last_selections``), for a check that
        #: feeds them to the float64 reference (``MLAEngine(keep_selections=True)``).
        self.record_selections = False
        #: The last sparse step's selections when recording: ``[indexer layers, T, ceil(the
        #: step's most visible keys / 8)]`` uint8 bitmasks (``app.model.sparse.selections``),
        #: its rows those of the step's output.
        self.last_selections: torch.Tensor | None = None
        self.indexers: list[LayerIndexer | None] = []
        self.key_caches: list[PagedLatentCache | None] = []
        self.sparse_executors: list[SparseMLAExecutor] = []
        self.prefill_executors: list[MLAPrefillExecutor] = []
        self.decode_executors: list[MLADecodeExecutor] = []
        if arch.indexer is not None:
            self._build_sparse(weights, rope, indexer or TorchSparseIndexer(), num_blocks,
                               block_size)
            return
        self.prefill_executors = [
            MLAPrefillExecutor(attn, cache, prefill_backend, chunk, self.timer)
            for attn, cache in zip(self.attention, self.caches, strict=True)]
        self.decode_executors = [MLADecodeExecutor(attn, cache, decode_backend, self.timer)
                                 for attn, cache in zip(self.attention, self.caches, strict=True)]

    def _build_sparse(self, weights: ModelWeights, rope: RotaryEmbedding,
                      selector: SparseIndexer, num_blocks: int, block_size: int) -> None:
        """A sparse model's layers: each with its indexer and key cache (or none, shared)."""
        arch, indexer = self.arch, self.arch.indexer
        if indexer is None:  # pragma: no cover - called for sparse models only
            raise ValueError("not a sparse model")
        for layer in weights.layers:
            own = layer.attention.indexer
            self.indexers.append(None if own is None else LayerIndexer(
                indexer, own, rope_dim=arch.qk_rope_head_dim, rope=self.attention[0].rope,
                dtype=self.dtype, compute_dtype=self.compute_dtype, device=self.device))
            self.key_caches.append(None if own is None else PagedLatentCache(
                num_blocks, block_size, indexer.index_head_dim, self.dtype, self.device))
        self.sparse_executors = [
            SparseMLAExecutor(attn, cache, indexer=layer_indexer, key_cache=key_cache,
                              selector=selector, index_topk=indexer.index_topk,
                              prefill_backend=self.prefill_backend,
                              decode_backend=self.decode_backend, timer=self.timer)
            for attn, cache, layer_indexer, key_cache in zip(
                self.attention, self.caches, self.indexers, self.key_caches, strict=True)]

    @property
    def is_sparse(self) -> bool:
        """Whether the model runs DeepSeek Sparse Attention (an indexer per layer)."""
        return bool(self.sparse_executors)

    def latent_scales(self) -> list[float]:
        """Each layer's ``fp8`` cache scale (``app.model.attention.fp8_cache_scale``: the
        smallest power of two at or above the layer's latent bound over 448, so that no value
        a layer writes is clipped)."""
        return [fp8_cache_scale(self.arch, layer) for layer in self.weights.layers]

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.attention)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding and of the LM head."""
        return int(self._embed.shape[0])

    @property
    def hidden_size(self) -> int:
        """``D``."""
        return int(self._embed.shape[1])

    @property
    def reordered_weight_bytes(self) -> int:
        """Bytes of the weight copies reordered for the matmul path (``app.model.linear``),
        held beside the plain weights; 0 where nothing is reordered."""
        linears = [self._lm_head_linear]
        for attn, mlp in zip(self.attention, self.mlps, strict=True):
            linears += attn.linears() + mlp.linears()
        for layer_indexer in self.indexers:
            linears += [] if layer_indexer is None else layer_indexer.linears()
        return sum(linear.nbytes for linear in linears)

    @property
    def cache_bytes(self) -> int:
        """Bytes of every layer's cache storage (latent, and a sparse model's key caches)."""
        return sum(cache.nbytes for cache in (*self.caches, *self.key_caches)
                   if cache is not None)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [T]`` int64 -> ``[T, D]`` in the model dtype on the device."""
        if token_ids.device.type == "cpu":   # the host's ids: copied without a sync
            token_ids = copy_to_device(token_ids, self.device)
        return self._embed.index_select(0, token_ids.to(self.device))

    def _input_norm(self, i: int, h: torch.Tensor) -> torch.Tensor:
        with self.timer.phase("mlp"):
            return rms_norm(h, self._norms[i][0], self.eps)

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """``h += mlp(RMSNorm(h))`` in place (``h`` is the step's own residual stream), over
        chunks of at most ``FEED_FORWARD_CHUNK`` rows."""
        with self.timer.phase("mlp"):
            mlp, norm = self.mlps[i], self._norms[i][1]
            for start in range(0, h.shape[0], FEED_FORWARD_CHUNK):
                rows = h[start:start + FEED_FORWARD_CHUNK]
                rows += mlp(rms_norm(rows, norm, self.eps)).to(self.dtype)
            return h

    def _final(self, h: torch.Tensor) -> torch.Tensor:
        with self.timer.phase("mlp"):
            return rms_norm(h, self._final_norm, self.eps)

    def plan_prefill(self, batch: Sequence[PrefillSlice]) -> PrefillPlan:
        """The plan of a prefill step over ``batch`` (every layer shares the block table; a
        sparse model's is a ``SparsePrefillPlan``)."""
        if not self.is_sparse:
            return self.prefill_executors[0].plan(batch)
        plan = plan_prefill_step(batch, block_size=self.caches[0].block_size,
                                 context_chunk_tokens=self.config.attention.context_chunk_tokens,
                                 device=self.device)
        return plan_sparse_prefill(batch, plan)

    def warn_fp8_overflows(self, reported: int) -> int:
        """The latent values an ``fp8`` cache saturated so far (``fp8_overflows``, all layers),
        with a warning when that grew past ``reported``: the per-layer scale is derived so that
        nothing saturates (``latent_scales``), so those tokens' keys were clipped to
        +-448 x scale against the derivation."""
        total = int(self.fp8_overflows.sum())
        if total > reported:
            logger.warning("fp8 KV cache: %d latent value(s) beyond their layer's scale were "
                           "saturated so far (per layer: %s); the scales are %s",
                           total, self.fp8_overflows.tolist(), [c.k_scale for c in self.caches])
        return total

    def plan_decode(self, block_tables: Sequence[torch.Tensor], num_computed: Sequence[int],
                    query_len: int, *, pad: bool = True) -> DecodePlan:
        """The plan of a decode step (``plan_decode_step`` on this model's caches; a sparse
        model's is a ``SparseDecodePlan``, never padded), padded (unless ``pad`` is False) to the
        smallest of ``decode_batch_sizes`` that holds the batch (none: not padded)."""
        batch = len(block_tables)
        # a sparse step is not padded: the indexer's layout is built from the real rows only
        pad_to = next((n for n in self.decode_batch_sizes if n >= batch), None) \
            if pad and not self.is_sparse else None
        plan = plan_decode_step(block_tables, num_computed, query_len,
                                self.caches[0].block_size, self.device,
                                pad_to=None if pad_to == batch else pad_to)
        return plan_sparse_decode(plan) if self.is_sparse else plan

    def _layers(self, h: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor],
                watch: Watch | None) -> torch.Tensor:
        """Every decoder layer and the final norm over the embedded ``h``; ``watch`` sees each
        stage's output (a check a step pays only when it asks)."""
        if watch is not None:
            watch("the token embedding (model.embed_tokens)", h)
        for i in range(self.num_layers):
            h = h + attend(i, self._input_norm(i, h))
            if watch is not None:
                watch(f"layer {i}'s attention (model.layers.{i}.self_attn)", h)
            h = self._mlp(i, h)
            if watch is not None:
                watch(f"layer {i}'s MLP (model.layers.{i}.mlp)", h)
        h = self._final(h)
        if watch is not None:
            watch("the final norm (model.norm)", h)
        return h

    def locate_non_finite(self, forward: Callable[[Watch], torch.Tensor]) -> str:
        """Where a forward pass first produces a value that is not finite: ``forward(watch)``
        re-runs a step (``lambda watch: model.decode(ids, plan, watch=watch)``; writing the
        same cache slots again with the same values) with every stage checked. A stage in
        words: ``"layer 3's attention (model.layers.3.self_attn)"``, or the LM head when every
        hidden state is finite but a logit is not."""
        try:
            hidden = forward(_stop_at_non_finite)
        except _NonFinite as found:
            return found.where
        if not bool(torch.isfinite(self.logits(hidden)).all()):
            return "the LM head (lm_head)"
        return "no stage when the step was run again (its results were not reproducible)"

    def prefill(self, token_ids: torch.Tensor, batch: Sequence[PrefillSlice] | PrefillPlan, *,
                watch: Watch | None = None) -> torch.Tensor:
        """A chunked-prefill step of every layer: ``token_ids [T]`` are the new tokens of
        ``batch`` (request by request; or its plan, ``plan_prefill(batch)``). Returns the final
        normed hidden states ``[T, D]`` (``watch``: see ``Watch``)."""
        with self.timer.phase("metadata"):
            plan = batch if isinstance(batch, PrefillPlan) else self.plan_prefill(batch)
            if token_ids.dim() != 1 or token_ids.shape[0] != plan.metadata.total_q:
                raise ValueError(f"token_ids must be [{plan.metadata.total_q}], got "
                                 f"{list(token_ids.shape)}")
            self.prefill_backend.prepare_metadata(plan.metadata)
            h = self.embed(token_ids)
        if self.is_sparse:
            if not isinstance(plan, SparsePrefillPlan):
                raise TypeError("a sparse model's prefill needs its own plan: pass the batch, "
                                "or model.plan_prefill(batch)")
            sparse, step = self.sparse_executors, self._selection()
            out = self._layers(h, lambda i, x: sparse[i].run_prefill(x, plan, step), watch)
            self._recorded(step)
            return out
        executors = self.prefill_executors
        return self._layers(h, lambda i, x: executors[i].run_planned(x, plan), watch)

    def decode(self, token_ids: torch.Tensor, plan: DecodePlan, *,
               watch: Watch | None = None) -> torch.Tensor:
        """A decode step of every layer over a planned batch (``plan_decode``): ``token_ids
        [B * query_len]`` (request-major). Returns the final normed hidden states
        ``[B * query_len, D]`` (``watch``: see ``Watch``); of a padded plan, ``[plan.batch *
        query_len, D]``, the padding's rows (token 0) after the real ones."""
        rows = plan.slots.shape[0]
        if token_ids.dim() == 1 and token_ids.shape[0] < rows:
            token_ids = torch.cat([token_ids, token_ids.new_zeros(rows - token_ids.shape[0])])
        with self.timer.phase("decode_metadata"):
            self.decode_backend.prepare_metadata(plan.metadata)
            h = self.embed(token_ids)
        if self.is_sparse:
            sparse_plan = plan if isinstance(plan, SparseDecodePlan) else plan_sparse_decode(plan)
            sparse, step = self.sparse_executors, self._selection()
            out = self._layers(h, lambda i, x: sparse[i].run_decode(x, sparse_plan, step),
                               watch)
            self._recorded(step)
            return out
        executors = self.decode_executors
        return self._layers(h, lambda i, x: executors[i].run_planned(x, plan), watch)

    def take_selections(self) -> torch.Tensor | None:
        """The last step's recorded selections (``last_selections``) on the CPU, None when
        none (then forgotten: a rerun of the step does not replace them)."""
        chosen, self.last_selections = self.last_selections, None
        return None if chosen is None else chosen.cpu()

    def _selection(self) -> SparseSelection:
        """A step's selection state (recording when ``record_selections``)."""
        return SparseSelection(self.record_selections)

    def _recorded(self, step: SparseSelection) -> None:
        """Keep ``step``'s recorded selections as ``last_selections`` (when recording)."""
        if step.chosen:
            width = max(int(c.shape[1]) for c in step.chosen)
            self.last_selections = torch.stack([
                torch.nn.functional.pad(c, (0, width - int(c.shape[1])), value=-1)
                for c in step.chosen])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: ``hidden [N, D]`` -> logits ``[N, vocab]`` in the compute dtype."""
        with self.timer.phase("lm_head"):
            return self._lm_head_linear(hidden.to(self.compute_dtype))

    def greedy(self, hidden: torch.Tensor) -> GreedyChoice:
        """Greedy tokens of ``hidden [N, D]`` with float32 margins and log-probabilities (see
        the module docstring)."""
        logits = self.logits(hidden)
        with self.timer.phase("sample"):
            n, vocab = logits.shape
            if vocab < 2:
                return GreedyChoice(logits.argmax(dim=1).tolist(), [float("inf")] * n,
                                    [0.0] * n)
            if logits.dtype == torch.float32:
                lse = torch.logsumexp(logits, dim=1)
                top = torch.topk(logits, 2, dim=1)
                values, indices = top.values, top.indices
            else:
                candidates = torch.topk(logits, min(GREEDY_CANDIDATES, vocab), dim=1).indices
                rows = self._lm_head.index_select(0, candidates.reshape(-1)).view(
                    n, candidates.shape[1], -1).float()
                exact = torch.einsum("nkd,nd->nk", rows, hidden.float())
                # The softmax's normaliser with the largest logits (which dominate it) exact.
                lse = torch.logsumexp(logits.float().scatter_(1, candidates, exact), dim=1)
                best = torch.topk(exact, 2, dim=1)
                values, indices = best.values, candidates.gather(1, best.indices)
            # One readback for the three (the step's only wait for the device): token ids
            # below 2**53 are exact in float64.
            packed = torch.stack([indices[:, 0].double(),
                                  (values[:, 0] - values[:, 1]).double(),
                                  (values[:, 0] - lse).double()]).tolist()
            return GreedyChoice([int(t) for t in packed[0]], packed[1], packed[2])
