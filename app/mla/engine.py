"""A minimal prefill engine around the MLA executor: how an engine embeds this library.

``MLAPrefillEngine`` resolves everything it needs through the container **once**, at start-up:
the platform, the selected prefill backend class (``get_mla_prefill_backend``), and the KV-cache
bindings (``get_kv_cache_groups`` + ``KVCacheManager`` over one ``MLAAttentionSpec`` layer
group). After that the hot path holds plain references; nothing is resolved per step or layer.

Each ``step()``:

1. schedules up to ``step_tokens`` new tokens (chunked prefill): running requests first, then
   waiting ones in arrival order; a new request first looks up the prefix cache
   (``get_computed_blocks``) and skips the tokens it hits; ``allocate_slots`` gives each
   scheduled request slots for its tokens, and a request that does not fit keeps waiting (FCFS:
   later ones do not overtake it). If nothing fits while requests hold blocks, the newest
   running request is preempted (its blocks freed, recomputed later);
2. runs the layer over the scheduled tokens (``MLAPrefillExecutor``);
3. reports the written KV (``cache_blocks``: full blocks become prefix-cache hits for later
   requests) and frees finished requests.

A request that can never fit (more blocks than the pool has) is refused by ``add_request`` with
``RequestTooLargeError``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from app._validation import check_int_at_least
from app.backends.base import MLAPrefillBackend
from app.backends.selector import get_mla_prefill_backend
from app.config import EngineConfig
from app.containers import get_container
from app.kvcache import KVCacheGroupSpec, KVCacheManager, MLAAttentionSpec, get_kv_cache_groups
from app.kvcache.request import KVCacheRequest
from app.mla.cache import PagedLatentCache
from app.mla.executor import MLAPrefillExecutor, PrefillSlice
from app.mla.layer import MLALayer, MLALayerWeights, TokenEmbedding, default_compute_dtype
from app.mla.profiling import NULL_TIMER, PhaseTimer

if TYPE_CHECKING:
    from app.containers import Application
    from app.platforms import Platform

__all__ = [
    "LAYER_NAME",
    "EngineStats",
    "MLAPrefillEngine",
    "RequestOutput",
    "RequestTooLargeError",
    "StepOutput",
]

#: The name of the engine's single MLA attention layer (its KV-cache group's layer).
LAYER_NAME = "model.layers.0.self_attn"
#: Default vocabulary of the seeded token embedding.
DEFAULT_VOCAB_SIZE = 4096


class RequestTooLargeError(ValueError):
    """A request needs more KV-cache blocks than the whole pool has: it can never run."""


@attrs.frozen(eq=False)
class RequestOutput:
    """A finished request.

    ``output [num_tokens, hidden]`` (model dtype, on the engine's device) holds the layer output
    of the rows this request computed (``computed_rows``, a bool mask); the other rows were
    prefix-cache hits, computed by an earlier request, and are zero here.
    ``num_cached_tokens`` is the prefix-cache hit when the request was first admitted.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_cached_tokens: int
    num_preemptions: int
    output: torch.Tensor | None
    computed_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Prompt length."""
        return len(self.token_ids)


@attrs.frozen
class StepOutput:
    """One step: the requests scheduled (id, context tokens, new tokens) and those finished."""

    step: int
    scheduled: tuple[tuple[str, int, int], ...]
    finished: tuple[RequestOutput, ...]
    num_preempted: int
    seconds: float

    @property
    def num_new_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(n for _, _, n in self.scheduled)


@attrs.define
class EngineStats:
    """Counters since the engine started."""

    steps: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished_requests: int = 0
    preemptions: int = 0
    peak_used_blocks: int = 0
    step_seconds: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens (finished requests)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Computed prefill tokens per second of step time."""
        return self.computed_tokens / self.step_seconds if self.step_seconds else 0.0


@attrs.define(eq=False)
class _Request:
    kv: KVCacheRequest
    token_ids: tuple[int, ...]
    token_tensor: torch.Tensor
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    block_table: torch.Tensor | None = None
    output: torch.Tensor | None = None
    computed_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class MLAPrefillEngine:
    """Queue, chunked-prefill scheduler, paged latent cache and one MLA layer.

    ``config`` defaults to the container's config; ``container`` to the active one. ``weights``
    default to ``MLALayerWeights.generate(config.model, seed)``; the inputs are rows of a seeded
    ``TokenEmbedding`` of ``vocab_size`` tokens. ``keep_outputs=False`` drops the outputs
    (benchmarks). ``timer`` (a ``PhaseTimer``) charges each phase of each step.
    """

    def __init__(self, config: EngineConfig | None = None, *,
                 container: Application | None = None, seed: int = 0,
                 step_tokens: int = 8192, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 weights: MLALayerWeights | None = None, keep_outputs: bool = True,
                 timer: PhaseTimer | None = None) -> None:
        check_int_at_least("step_tokens", step_tokens, 1)
        container = get_container() if container is None else container
        config = container.config() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if weights is not None and weights.model != config.model:
            raise ValueError("weights were generated for another ModelConfig than config.model")
        self.config = config
        self.container = container
        # -- resolved once: platform, backend class, KV-cache bindings ----------------------
        self.platform: Platform = container.platform()
        self.backend_class: type[MLAPrefillBackend] = get_mla_prefill_backend(
            config, container=container)
        spec = MLAAttentionSpec.from_model_config(config.model,
                                                  block_size=config.cache.block_size)
        bindings = container.kv_cache_spec_bindings()
        self.kv_cache_groups: list[KVCacheGroupSpec] = get_kv_cache_groups({LAYER_NAME: spec},
                                                                            bindings)
        self.kv_manager = KVCacheManager(self.kv_cache_groups, config.cache, bindings=bindings)
        if len(self.kv_cache_groups) != 1:  # pragma: no cover - one layer, one group
            raise ValueError(f"expected one KV-cache group, got {len(self.kv_cache_groups)}")
        #: Tokens per block of the (single) group's block table.
        self.block_size = self.kv_cache_groups[0].block_size
        # -- the model side -----------------------------------------------------------------
        device = self.platform.device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"platform {self.platform!r} runs on device 'cuda', but torch sees "
                             "no CUDA device here (an emulated platform can select backends, "
                             "not run them)")
        model = config.model
        self.weights = weights if weights is not None else MLALayerWeights.generate(model, seed)
        self.embedding = TokenEmbedding.generate(vocab_size, model.hidden_size, model.dtype, seed)
        compute = default_compute_dtype(model.dtype, device, self.platform.has_fast_bfloat16())
        self.layer = MLALayer(self.weights, device, compute_dtype=compute)
        self._embedding_rows = self.embedding.table.to(device=device, dtype=model.dtype)
        self.cache = PagedLatentCache(self.kv_manager.block_pool.num_blocks, self.block_size,
                                      self.layer.latent_dim, model.dtype, device)
        self.backend = self.backend_class.from_config(
            config, device_capability=self.platform.get_device_capability(),
            workspaces=container.kernel_workspaces())
        self.timer = timer if timer is not None else NULL_TIMER
        self.executor = MLAPrefillExecutor(self.layer, self.cache, self.backend,
                                           config.attention.context_chunk_tokens, self.timer)
        self.step_tokens = step_tokens
        self.keep_outputs = keep_outputs
        self.device = device
        self.stats = EngineStats()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self.initial_free_blocks = self.kv_manager.num_free_blocks

    # -- requests -----------------------------------------------------------------------------

    @property
    def max_request_tokens(self) -> int:
        """The longest request the pool can ever hold."""
        return (self.kv_manager.block_pool.num_blocks - 1) * self.block_size

    def add_request(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Queue a request. ``RequestTooLargeError`` when it can never fit in the pool;
        ``ValueError`` for an empty request, a token outside the vocabulary or a duplicate id."""
        tokens = tuple(int(t) for t in token_ids)
        if not tokens:
            raise ValueError(f"request {request_id!r} has no tokens")
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        vocab = self.embedding.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"request {request_id!r}: token ids must be in [0, {vocab}), got "
                             f"[{min(tokens)}, {max(tokens)}]")
        bs = self.block_size
        needed = -(-len(tokens) // bs)
        usable = self.kv_manager.block_pool.num_blocks - 1
        if needed > usable:
            raise RequestTooLargeError(
                f"request {request_id!r} has {len(tokens)} tokens and needs {needed} KV-cache "
                f"blocks of {bs} tokens, but the pool has only {usable} usable blocks "
                f"(cache.num_blocks={usable + 1}, block 0 is reserved); it can never run. "
                f"Raise cache.num_blocks to at least {needed + 1} or shorten the request "
                f"(at most {self.max_request_tokens} tokens).")
        kv = self.kv_manager.new_request(request_id, tokens)
        self._waiting.append(_Request(kv=kv, token_ids=tokens,
                                      token_tensor=torch.tensor(tokens, dtype=torch.int64)))
        self._ids.add(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (or preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV-cache blocks."""
        return len(self._running)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running)

    # -- scheduling ---------------------------------------------------------------------------

    def _refresh_block_table(self, req: _Request) -> None:
        ids = self.kv_manager.get_block_ids(req.kv.request_id)[0]
        req.block_table = torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _admit(self, req: _Request, num_hit: int) -> None:
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if self.keep_outputs and req.output is None:
            req.output = torch.zeros(req.num_tokens, self.config.model.hidden_size,
                                     dtype=self.config.model.dtype, device=self.device)
        if req.computed_rows is None:
            req.computed_rows = torch.zeros(req.num_tokens, dtype=torch.bool)

    def _schedule(self) -> tuple[list[tuple[_Request, int, int]], int]:
        """``[(request, context tokens, new tokens)]`` for this step, and the preemptions."""
        manager = self.kv_manager
        preempted = 0
        while True:
            budget = self.step_tokens
            scheduled: list[tuple[_Request, int, int]] = []
            for req in self._running:
                if budget == 0:
                    break
                done = req.kv.num_computed_tokens
                n = min(req.num_tokens - done, budget)
                new_blocks = manager.allocate_slots(req.kv, n)
                if new_blocks is None:
                    continue  # waits for blocks; keeps what it holds
                if new_blocks.num_blocks:
                    self._refresh_block_table(req)
                scheduled.append((req, done, n))
                budget -= n
            while self._waiting and budget > 0:
                req = self._waiting[0]
                hit = manager.get_computed_blocks(req.kv)
                n = min(req.num_tokens - hit.num_computed_tokens, budget)
                if manager.allocate_slots(req.kv, n, hit) is None:
                    break  # FCFS: it waits, and nobody overtakes it
                self._waiting.popleft()
                self._admit(req, hit.num_computed_tokens)
                self._refresh_block_table(req)
                self._running.append(req)
                scheduled.append((req, req.kv.num_computed_tokens, n))
                budget -= n
            if scheduled or not self._running:
                return scheduled, preempted
            # Every running request is stuck on blocks held by the others: preempt the newest.
            victim = self._running.pop()
            manager.free(victim.kv)
            victim.num_preemptions += 1
            victim.block_table = None
            self._waiting.appendleft(victim)
            preempted += 1

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule, run and account one step (see the module docstring)."""
        start = time.perf_counter()
        timer = self.timer
        with timer.phase("schedule"):
            scheduled, preempted = self._schedule()
        finished: list[RequestOutput] = []
        if scheduled:
            with timer.phase("metadata"):
                batch = []
                for req, done, n in scheduled:
                    if req.block_table is None:  # pragma: no cover - set on admission
                        raise RuntimeError(f"request {req.kv.request_id!r} has no block table")
                    batch.append(PrefillSlice(req.block_table, done, n))
                ids = torch.cat([req.token_tensor[done:done + n] for req, done, n in scheduled])
                x = self._embedding_rows.index_select(0, ids.to(self.device))
            out = self.executor.forward(x, batch)
            with timer.phase("schedule"):
                offset = 0
                for req, done, n in scheduled:
                    if req.output is not None:
                        req.output[done:done + n] = out[offset:offset + n]
                    if req.computed_rows is not None:
                        req.computed_rows[done:done + n] = True
                    offset += n
                    self.kv_manager.cache_blocks(req.kv, done + n)
                used = self.kv_manager.block_pool.num_used_blocks
                self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, used)
                for req, _, _ in scheduled:
                    if req.kv.num_computed_tokens >= req.num_tokens:
                        finished.append(self._finish(req))
        seconds = time.perf_counter() - start
        stats = self.stats
        stats.steps += 1
        stats.preemptions += preempted
        stats.computed_tokens += sum(n for _, _, n in scheduled)
        stats.step_seconds += seconds
        return StepOutput(step=stats.steps,
                          scheduled=tuple((r.kv.request_id, d, n) for r, d, n in scheduled),
                          finished=tuple(finished), num_preempted=preempted, seconds=seconds)

    def _finish(self, req: _Request) -> RequestOutput:
        self.kv_manager.free(req.kv)
        self._running.remove(req)
        self._ids.discard(req.kv.request_id)
        stats = self.stats
        stats.finished_requests += 1
        stats.prompt_tokens += req.num_tokens
        stats.cached_tokens += max(req.num_cached_tokens, 0)
        rows = req.computed_rows if req.computed_rows is not None else torch.zeros(
            req.num_tokens, dtype=torch.bool)
        result = RequestOutput(request_id=req.kv.request_id, token_ids=req.token_ids,
                               num_cached_tokens=max(req.num_cached_tokens, 0),
                               num_preemptions=req.num_preemptions, output=req.output,
                               computed_rows=rows)
        req.output = None
        return result

    def run(self, requests: Sequence[tuple[str, Sequence[int]]] = ()) -> list[RequestOutput]:
        """Add ``requests`` and step until every request is finished; the outputs, in finishing
        order."""
        for request_id, tokens in requests:
            self.add_request(request_id, tokens)
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            step = self.step()
            if not step.scheduled and not self._running:
                # Nothing runs and the head of the queue does not fit in a pool nobody in this
                # engine holds: the blocks are held elsewhere, and waiting would never end.
                raise RuntimeError(
                    f"no progress: request {self._waiting[0].kv.request_id!r} does not fit "
                    f"although no request of this engine holds blocks "
                    f"({self.kv_manager.num_free_blocks} free of "
                    f"{self.kv_manager.block_pool.num_blocks - 1})")
            outputs.extend(step.finished)
        return outputs

    # -- introspection ------------------------------------------------------------------------

    def pool_usage(self) -> dict[str, Any]:
        """Blocks of the pool: total, free now, used now, peak used, cached (prefix cache)."""
        pool = self.kv_manager.block_pool
        return {"num_blocks": pool.num_blocks, "block_size": self.block_size,
                "free_blocks": pool.num_free_blocks, "used_blocks": pool.num_used_blocks,
                "peak_used_blocks": self.stats.peak_used_blocks,
                "cached_blocks": pool.num_cached_blocks,
                "cache_bytes": self.cache.nbytes}

    def describe_kv_cache_groups(self) -> list[dict[str, Any]]:
        """The KV-cache groups: layers, spec, manager class, page size."""
        result = []
        for group, manager in zip(self.kv_cache_groups, self.kv_manager.managers, strict=True):
            spec = group.kv_cache_spec
            result.append({"layers": list(group.layer_names), "spec": type(spec).__name__,
                           "manager": type(manager).__name__, "block_size": group.block_size,
                           "head_size": getattr(spec, "head_size", None),
                           "dtype": str(getattr(spec, "dtype", "")).removeprefix("torch."),
                           "page_size_bytes": group.page_size_bytes})
        return result
