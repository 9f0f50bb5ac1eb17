"""The generating engine: continuous batching of prefill and decode over one paged latent cache.

``MLAEngine`` is how an engine embeds this library. It builds everything from its container,
**once**, at start-up: the one config (``container.config()``), the platform, a prefill backend
instance (``container.mla_prefill_backend()``), a decode backend instance for the step's query
length (``container.mla_decode_backend(query_len=1 + num_speculative_tokens)``; selection
checks the cache block size), the kernel workspaces and the KV-cache spec bindings
(``get_kv_cache_groups`` + ``KVCacheManager`` over one ``MLAAttentionSpec`` group of the
model's layers; a sparse model's indexer key caches, ``IndexerKeyCacheSpec``, in the same group:
one block table) and, for a sparse model, its indexer (``container.sparse_indexer()``). To
replace a backend for one engine, override the container's providers. Afterwards the hot path
holds plain references; nothing is resolved per step or per layer.

Serving::

    loaded = load_checkpoint("DeepSeek-V2-Lite")            # app.model.load_checkpoint
    config = EngineConfig(model=loaded.config.model_config())
    engine = MLAEngine(create_container(config), weights=loaded.weights)
    engine.add_request(Request("r1", prompt_token_ids, max_new_tokens=64,
                               stop_token_ids=loaded.eos_token_ids))
    while engine.has_unfinished():
        out = engine.step()        # out.new_tokens: {request_id: tokens emitted this step}
        for done in out.finished:  # RequestOutput: tokens, log-probs, finish reason, metrics
            ...
    engine.abort("r2")             # frees everything a request holds

Each ``step()``: the ``Scheduler`` (``app.mla.scheduler``) picks the decode batch and the chunked
prefill batch; the model (``app.model.DeepseekModel``) runs the prefill batch in the
non-absorbed form through the prefill backend and the decode batch in the absorbed form through
the decode backend; the LM head picks greedy tokens (drafts are verified,
``app.mla.speculative``); progress is reported to the ``KVCacheManager`` (full blocks become
prefix-cache hits) and finished requests free their blocks.

Non-finite logits (NaN weights, an overflow) end that request with ``FinishReason.ERROR`` and
an ``error`` naming the step and the first stage of the model that produced a non-finite value
(the step run again with every stage checked; the hot path looks once at the step's
log-probabilities). A speculative step emits no token of a row at or after its first
non-finite row (``app.mla.nonfinite``, which also covers backends that do not isolate them).

``run(requests)`` may be called from several threads at once: the calls share the steps (their
requests are batched together) and each returns exactly its own requests' outputs, whichever
call's step finished them (see ``run``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from dependency_injector import containers

from app._validation import check_int, check_int_at_least
from app.backends.decode.base import MAX_QUERY_LEN, MLADecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.config import EngineConfig
from app.containers import get_container
from app.kvcache.grouping import (
    KVCacheGroupSpec,
    get_kv_cache_bytes_per_block,
    get_kv_cache_groups,
)
from app.kvcache.kv_cache_manager import KVCacheManager
from app.mla.nonfinite import decode_error, non_finite_rows, trusted_rows, verify_rows
from app.mla.requests import (
    EngineStats,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestTooLargeError,
    RowKind,
    StepOutput,
)
from app.mla.scheduler import RequestState, Scheduler, SchedulerOutput
from app.mla.speculative import NgramDrafter
from app.model.cache import check_cache_fits
from app.model.model import DeepseekModel, default_compute_dtype
from app.model.prefill import PrefillSlice
from app.model.profiling import NULL_TIMER, PhaseTimer
from app.model.sparse.kv_spec import model_kv_cache_specs
from app.model.sparse.selections import check_keep_selections
from app.model.weights import ModelWeights

if TYPE_CHECKING:
    from app.containers import Application
    from app.platforms import Platform

__all__ = ["EngineStats", "MLAEngine", "RequestTooLargeError", "StepOutput"]


class MLAEngine:
    """Queue, scheduler, paged latent cache and a DeepSeek model (``weights``).

    ``container`` (default: the active one) gives the config, the platform, the backends and
    the KV-cache bindings; ``weights`` must match its ``config.model`` (heads, dims, softmax
    scale: build it with ``DeepseekConfig.model_config``). ``step_tokens`` is the token budget
    per step, ``max_num_seqs`` the most running requests, ``num_speculative_tokens`` the
    n-gram drafts verified per decode step (0: plain decoding). ``keep_outputs=False`` drops
    the per-row outputs (benchmarks); ``keep_selections=True`` (a sparse model, with
    ``keep_outputs``) also keeps every row's selections (``RequestOutput.selections``: bitmasks,
    ``S / 8`` bytes per row and indexer layer). ``timer`` charges each step's phases.
    ``decode_batch_sizes`` pads each decode step's batch up to the smallest that holds it
    (``DeepseekModel``; none by default).
    """

    def __init__(self, container: Application | None = None, *, weights: ModelWeights,
                 step_tokens: int = 8192, max_num_seqs: int = 256,
                 num_speculative_tokens: int = 0, keep_outputs: bool = True,
                 timer: PhaseTimer | None = None, decode_batch_sizes: Sequence[int] = (),
                 keep_selections: bool = False) -> None:
        check_int_at_least("step_tokens", step_tokens, 1)
        check_int_at_least("max_num_seqs", max_num_seqs, 1)
        check_int("MLAEngine: num_speculative_tokens", num_speculative_tokens, 0,
                  MAX_QUERY_LEN - 1)   # a decode step's query: 1 + the drafts
        if not isinstance(keep_outputs, bool):
            raise TypeError(f"MLAEngine: keep_outputs must be a bool, got {keep_outputs!r}")
        if timer is not None and not isinstance(timer, PhaseTimer):
            raise TypeError(f"MLAEngine: timer must be an app.model.profiling.PhaseTimer or "
                            f"None, got {type(timer).__name__}")
        if isinstance(container, EngineConfig):
            raise TypeError("MLAEngine takes its config from its container: pass "
                            "MLAEngine(create_container(config), weights=...)")
        container = get_container() if container is None else container
        if not containers.is_container(container):
            raise TypeError(f"MLAEngine: expected an app.containers.Application, got "
                            f"{type(container).__name__}")
        if not isinstance(weights, ModelWeights):
            raise TypeError(f"MLAEngine: weights must be app.model.ModelWeights (load_checkpoint "
                            f"or random_weights), got {type(weights).__name__}")
        check_keep_selections(keep_selections, keep_outputs, weights.config.indexer is not None)
        config: EngineConfig = container.config()
        self.config = config
        self.container = container
        weights.config.check_model_config(config.model)
        # -- built once from the container: platform, backends, KV-cache bindings ----------
        self.platform: Platform = container.platform()
        device = self.platform.device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"platform {self.platform!r} runs on device 'cuda', but torch sees "
                             "no CUDA device here (an emulated platform can select backends, "
                             "not run them)")
        prefill_backend: MLAPrefillBackend = container.mla_prefill_backend()
        decode_backend: MLADecodeBackend = container.mla_decode_backend(
            query_len=1 + num_speculative_tokens)
        self.backend_class: type[MLAPrefillBackend] = type(prefill_backend)
        self.decode_backend_class: type[MLADecodeBackend] = type(decode_backend)
        num_layers = weights.num_layers
        bindings = container.kv_cache_spec_bindings()
        self.kv_cache_groups: list[KVCacheGroupSpec] = get_kv_cache_groups(
            model_kv_cache_specs(weights.config, config.model, block_size=config.cache.block_size,
                                 bindings=bindings, kv_cache_dtype=config.cache.kv_cache_dtype),
            bindings)
        if len(self.kv_cache_groups) != 1:
            raise ValueError(f"expected the model's caches in one KV-cache group (one block "
                             f"table), got {len(self.kv_cache_groups)}: "
                             f"{[g.describe() for g in self.kv_cache_groups]}")
        check_cache_fits(config, device, num_layers,
                         bytes_per_block=get_kv_cache_bytes_per_block(self.kv_cache_groups))
        self.kv_manager = KVCacheManager(self.kv_cache_groups, config.cache, bindings=bindings)
        #: Tokens per block of the group's block table.
        self.block_size = self.kv_cache_groups[0].block_size
        # -- the model --------------------------------------------------------------------
        self.device = device
        self.timer = timer if timer is not None else NULL_TIMER
        model = config.model
        # The platform answers for bf16; any other 16-bit dtype is decided by the device's own
        # features (an fp16 model on a CPU without AVX512-FP16 computes in float32).
        fast_bf16 = self.platform.has_fast_bfloat16() if model.dtype == torch.bfloat16 else None
        self.model = DeepseekModel(
            config, weights, prefill_backend, decode_backend,
            num_blocks=self.kv_manager.block_pool.num_blocks, block_size=self.block_size,
            device=device, compute_dtype=default_compute_dtype(model.dtype, device, fast_bf16),
            timer=self.timer, decode_batch_sizes=decode_batch_sizes,
            indexer=container.sparse_indexer() if weights.config.indexer is not None else None)
        self.scheduler = Scheduler(self.kv_manager, max_num_batched_tokens=step_tokens,
                                   max_num_seqs=max_num_seqs,
                                   num_speculative_tokens=num_speculative_tokens)
        self.drafter = NgramDrafter(num_speculative_tokens) if num_speculative_tokens else None
        self.num_speculative_tokens = num_speculative_tokens
        self.step_tokens = step_tokens
        self.keep_outputs = keep_outputs
        self.keep_selections = self.model.record_selections = keep_selections
        self.stats = EngineStats()
        self._states: dict[str, RequestState] = {}
        self.initial_free_blocks = self.kv_manager.num_free_blocks
        # add_request, abort and step may come from different threads (a server's request
        # handlers and its stepping loop): each runs whole, one at a time.
        self._lock = threading.RLock()
        # run(requests) calls in flight: which call owns a request, and the outputs of each
        # call's requests that finished (in any call's step, or aborted); outputs of requests
        # no call owns that a call's step finished, for the next step() or run().
        self._owners: dict[str, object] = {}
        self._mailboxes: dict[object, list[RequestOutput]] = {}
        self._unowned_finished: list[RequestOutput] = []
        # Why a request is ending with FinishReason.ERROR, until _finish reports it.
        self._errors: dict[str, str] = {}

    # -- convenience views --------------------------------------------------------------

    @property
    def weights(self) -> ModelWeights:
        """The model's weights."""
        return self.model.weights

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV-cache blocks."""
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    # -- requests -----------------------------------------------------------------------

    def blocks_needed(self, request: Request) -> int:
        """The most blocks ``request`` ever holds: its prompt, every generated token but the
        last (never computed) and the speculative lookahead."""
        tokens = len(request.prompt_token_ids) + request.max_new_tokens - 1 \
            + self.num_speculative_tokens
        return -(-tokens // self.block_size)

    def add_request(self, request: Request) -> None:
        """Queue ``request``. ``RequestTooLargeError`` when it can never fit in the pool;
        ``ValueError`` for a token outside the vocabulary or a duplicate id; nothing is queued
        on an error."""
        with self._lock:
            self._queue(request, self._check_request(request))

    def _check_request(self, request: Request) -> int:
        """The blocks ``request`` needs at most, once it is known to be one this engine can
        queue (see ``add_request``); changes nothing."""
        if not isinstance(request, Request):
            raise TypeError(f"add_request expects an app.mla.Request, got "
                            f"{type(request).__name__}")
        rid = request.request_id
        if rid in self._states:
            raise ValueError(f"request id {rid!r} is already queued or running")
        tokens = request.prompt_token_ids
        vocab = self.model.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"request {rid!r}: token ids must be in [0, {vocab}), got "
                             f"[{min(tokens)}, {max(tokens)}]")
        needed = self.blocks_needed(request)
        usable = self.kv_manager.block_pool.num_blocks - 1
        if needed > usable:
            raise RequestTooLargeError(
                f"request {rid!r} ({len(tokens)} prompt tokens + up to "
                f"{request.max_new_tokens} new) needs {needed} KV-cache blocks of "
                f"{self.block_size} tokens, but the pool has only {usable} usable blocks "
                f"(cache.num_blocks={usable + 1}, block 0 is reserved); it can never run. "
                f"Raise cache.num_blocks to at least {needed + 1}, or shorten the prompt or "
                f"max_new_tokens.")
        return needed

    def _queue(self, request: Request, needed: int) -> None:
        rid, tokens = request.request_id, request.prompt_token_ids
        state = RequestState(
            request=request, kv=self.kv_manager.new_request(rid, tokens),
            block_table=torch.zeros(needed, dtype=torch.int32),
            arrival_time=time.perf_counter(), arrival_step=self.stats.steps,
            ngram_index=self.drafter.new_index(tokens) if self.drafter else None)
        if self.keep_outputs:
            state.kept_rows = []
        if self.keep_selections:
            state.kept_selections = []
        self._states[rid] = state
        self.scheduler.add(state)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free every block it holds; its output (finish reason ``abort``),
        or None when no such request is queued or running."""
        with self._lock:
            state = self._states.get(request_id)
            if state is None:
                return None
            self.stats.aborted_requests += 1
            return self._finish(state, FinishReason.ABORT, time.perf_counter())

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule, run and account one step (see the module docstring). ``finished`` also
        holds the requests queued with ``add_request`` that a ``run`` call's step finished
        since the last ``step``."""
        with self._lock:
            out = self._step()
            if self._unowned_finished:
                out = attrs.evolve(out, finished=(*self._unowned_finished, *out.finished))
                self._unowned_finished.clear()
            return out

    def _step(self) -> StepOutput:
        start = time.perf_counter()
        timer = self.timer
        with timer.phase("schedule"):
            sched = self.scheduler.schedule()
            if self.drafter is not None:
                for state in sched.decode:
                    if state.ngram_index is not None:
                        state.drafts = self.drafter.propose(state.ngram_index)
        emitted: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        if sched.prefill:
            t0 = time.perf_counter()
            self._run_prefill(sched, emitted, reasons)
            self.stats.prefill_seconds += time.perf_counter() - t0
        if sched.decode:
            t0 = time.perf_counter()
            n = self._run_decode(sched, emitted, reasons)
            self.stats.decode_seconds += time.perf_counter() - t0
            self.stats.decode_emitted_tokens += n
        with timer.phase("schedule"):
            now = time.perf_counter()
            finished = tuple(self._finish(self._states[rid], reason, now)
                             for rid, reason in reasons.items())
            used = self.kv_manager.block_pool.num_used_blocks
            stats = self.stats
            stats.peak_used_blocks = max(stats.peak_used_blocks, used)
        seconds = time.perf_counter() - start
        stats.steps += 1
        stats.preemptions += len(sched.preempted)
        stats.prefill_tokens += sched.num_prefill_tokens
        stats.decode_tokens += sched.num_decode_tokens
        stats.step_seconds += seconds
        if self.model.caches[0].format.per_layer_scale and (finished or self.device.type == "cpu"):
            # reading the device's count waits for it: only at a step that finished a request
            stats.fp8_overflows = self.model.warn_fp8_overflows(stats.fp8_overflows)
        return StepOutput(step=stats.steps,
                          new_tokens={rid: tuple(t) for rid, t in emitted.items()},
                          finished=finished, preempted=sched.preempted,
                          num_prefill_tokens=sched.num_prefill_tokens,
                          num_decode_tokens=sched.num_decode_tokens, seconds=seconds)

    def _run_prefill(self, sched: SchedulerOutput, emitted: dict[str, list[int]],
                     reasons: dict[str, FinishReason]) -> None:
        with self.timer.phase("metadata"):
            batch = [PrefillSlice(st.block_table[:st.num_blocks].to(device=self.device,
                                                                     dtype=torch.int64),
                                  done, n) for st, done, n in sched.prefill]
            ids = torch.cat([torch.frombuffer(st.kv.token_ids, dtype=torch.int64)[done:done + n]
                             for st, done, n in sched.prefill])
            plan = self.model.plan_prefill(batch)
        hidden = self.model.prefill(ids, plan)
        chosen = self.model.take_selections()
        last_rows: list[int] = []
        completing: list[RequestState] = []
        with self.timer.phase("schedule"):
            offset = 0
            for st, done, n in sched.prefill:
                st.keep_rows(done, hidden[offset:offset + n], RowKind.PREFILL)
                st.keep_selection_rows(done, chosen, offset, n)
                self.kv_manager.cache_blocks(st.kv, done + n)
                offset += n
                if done + n == st.num_tokens:
                    last_rows.append(offset - 1)
                    completing.append(st)
        if completing:
            rows = torch.tensor(last_rows, dtype=torch.int64, device=hidden.device)
            choice = self.model.greedy(hidden.index_select(0, rows))
            bad = non_finite_rows(self.model, self.stats.steps + 1, choice,
                                  lambda watch: self.model.prefill(ids, plan, watch=watch))
            with self.timer.phase("schedule"):
                for i, st in enumerate(completing):
                    if i in bad:
                        self._fail(st, bad[i], reasons)
                        continue
                    self._emit(st, choice.tokens[i:i + 1], choice.margins[i:i + 1],
                               choice.logprobs[i:i + 1], emitted, reasons)

    def _run_decode(self, sched: SchedulerOutput, emitted: dict[str, list[int]],
                    reasons: dict[str, FinishReason]) -> int:
        states, q = sched.decode, sched.query_len
        k = q - 1
        with self.timer.phase("decode_metadata"):
            tables = [st.block_table for st in states]
            dones = [st.num_computed_tokens for st in states]
            plan = self.model.plan_decode(tables, dones, q)
            ids: list[int] = []
            for st in states:
                ids.append(st.kv.token_ids[-1])
                ids.extend(st.drafts if k else ())
            token_ids = torch.tensor(ids, dtype=torch.int64)
        hidden = self.model.decode(token_ids, plan)
        chosen = self.model.take_selections()
        choice = self.model.greedy(hidden)
        hidden, choice, first_bad = trusted_rows(
            self.model, self.decode_backend_class, tables, dones, ids, q, hidden, choice)
        count = 0
        failing: list[int] = []
        with self.timer.phase("schedule"):
            for b, st in enumerate(states):
                rows = slice(b * q, (b + 1) * q)
                verdict = verify_rows(st.drafts if k else [], choice.tokens[rows],
                                                first_bad[b])
                done = dones[b]
                out = self._emit(st, verdict.tokens, choice.margins[rows],
                                 choice.logprobs[rows], emitted, reasons)
                if verdict.error and st.request_id not in reasons:
                    failing.append(b)    # its next token needs a non-finite row
                computed = 1 + min(verdict.accepted, len(out) - 1)  # the last emitted is not
                st.keep_rows(done, hidden[b * q:b * q + computed], RowKind.DECODE)
                st.keep_selection_rows(done, chosen, b * q, computed)
                self.kv_manager.cache_blocks(st.kv, done + computed)
                if k:
                    st.num_draft_tokens += k
                    st.num_accepted_tokens += verdict.accepted
                    self.stats.draft_tokens += k
                    self.stats.accepted_tokens += verdict.accepted
                st.drafts = []
                count += len(out)
        if failing:
            message = decode_error(self.model, self.stats.steps + 1, tables, dones, ids, q,
                                   failing)
            for b in failing:
                self._fail(states[b], message, reasons)
        return count

    def _fail(self, st: RequestState, message: str, reasons: dict[str, FinishReason]) -> None:
        """End ``st`` with ``FinishReason.ERROR`` (no token emitted from a non-finite row)."""
        reasons[st.request_id] = FinishReason.ERROR
        self._errors[st.request_id] = f"request {st.request_id!r}: {message}"

    def _emit(self, st: RequestState, tokens: Sequence[int], margins: Sequence[float],
              logprobs: Sequence[float], emitted: dict[str, list[int]],
              reasons: dict[str, FinishReason]) -> list[int]:
        """Append ``tokens`` to the request up to its length limit or first stop token."""
        request = st.request
        out: list[int] = []
        for token, margin, logprob in zip(tokens, margins, logprobs, strict=False):
            out.append(token)
            st.logit_margins.append(margin)
            st.logprobs.append(logprob)
            if token in request.stop_token_ids:
                reasons[st.request_id] = FinishReason.STOP
                break
            if len(st.output_token_ids) + len(out) >= request.max_new_tokens:
                reasons[st.request_id] = FinishReason.LENGTH
                break
        if st.first_token_time is None and out:
            st.first_token_time = time.perf_counter()
            st.first_token_step = self.stats.steps + 1
        st.output_token_ids.extend(out)
        st.kv.append_token_ids(out)
        if st.ngram_index is not None:
            st.ngram_index.extend(out)
        emitted.setdefault(st.request_id, []).extend(out)
        self.stats.emitted_tokens += len(out)
        return out

    def _finish(self, st: RequestState, reason: FinishReason, now: float) -> RequestOutput:
        output = self._output(st, reason, now)
        owner = self._owners.pop(st.request_id, None)
        if owner is not None:   # a run call's request: its output goes to that call
            self._mailboxes[owner].append(output)
        return output

    def _output(self, st: RequestState, reason: FinishReason, now: float) -> RequestOutput:
        self.scheduler.finish(st)
        del self._states[st.request_id]
        stats = self.stats
        if reason is not FinishReason.ABORT:
            stats.finished_requests += 1
            stats.prompt_tokens += len(st.request.prompt_token_ids)
            stats.cached_tokens += max(st.num_cached_tokens, 0)
        total = st.num_tokens
        hidden, kinds = st.kept_outputs(total, self.model.hidden_size, self.config.model.dtype,
                                        self.device)
        metrics = RequestMetrics(
            arrival_time=st.arrival_time, arrival_step=st.arrival_step,
            first_token_time=st.first_token_time, first_token_step=st.first_token_step,
            finish_time=now, finish_step=self.stats.steps + (reason is not FinishReason.ABORT),
            num_draft_tokens=st.num_draft_tokens, num_accepted_tokens=st.num_accepted_tokens)
        return RequestOutput(
            request_id=st.request_id, prompt_token_ids=st.request.prompt_token_ids,
            output_token_ids=tuple(st.output_token_ids), finish_reason=reason,
            num_cached_tokens=max(st.num_cached_tokens, 0),
            num_preemptions=st.num_preemptions, logit_margins=tuple(st.logit_margins),
            logprobs=tuple(st.logprobs), metrics=metrics, hidden=hidden, row_kinds=kinds,
            error=self._errors.pop(st.request_id, None),
            selections=st.kept_selection_bits(
                sum(i is not None for i in self.model.indexers), total))

    def run(self, requests: Iterable[Request] = ()) -> list[RequestOutput]:
        """Add ``requests`` and step until every one of them is finished; exactly their
        outputs, in finishing order. Every request is checked before any is queued: one
        refused (see ``add_request``; also an id twice in ``requests``) queues none of them.

        Several threads may call ``run`` at once: steps run one at a time, each serving every
        call's requests together, and each call gets its own requests' outputs whichever
        call's step finished them (one aborted from another thread comes back with finish
        reason ``abort``). ``run()`` with no requests serves those queued with
        ``add_request`` instead (added before or while it runs): it steps until none of them
        is unfinished and returns theirs. Such a request finished by the step of a call that
        was given requests is handed to the next ``step()`` or ``run()``."""
        batch = list(requests)
        owner = object() if batch else None
        with self._lock:
            needed = [self._check_request(request) for request in batch]
            ids = [request.request_id for request in batch]
            if len(set(ids)) != len(ids):
                twice = sorted({rid for rid in ids if ids.count(rid) > 1})
                raise ValueError(f"run: request ids must be unique, got {twice} more than "
                                 f"once")
            for request, blocks in zip(batch, needed, strict=True):
                self._queue(request, blocks)
            if owner is not None:
                self._mailboxes[owner] = []
                self._owners.update(dict.fromkeys(ids, owner))
        outputs: list[RequestOutput] = []
        try:
            while not self._collect(owner, len(batch), outputs):
                pass
        finally:
            if owner is not None:
                with self._lock:   # an error left some unfinished: nobody's from now on
                    for rid in ids:
                        if self._owners.get(rid) is owner:
                            del self._owners[rid]
                    del self._mailboxes[owner]
        return outputs

    def _collect(self, owner: object | None, expected: int, outputs: list[RequestOutput]
                 ) -> bool:
        """One turn of ``run``: take what has finished for the call, or else take a step;
        True when the call is done. The lock is released between turns: another thread may
        add, abort or step."""
        with self._lock:
            if owner is None:
                outputs.extend(self._unowned_finished)
                self._unowned_finished.clear()
                if not any(rid not in self._owners for rid in self._states):
                    return True
            else:
                outputs.extend(self._mailboxes[owner])
                self._mailboxes[owner].clear()
                if len(outputs) == expected:
                    return True
            owned = set(self._owners)
            step = self._step()
            if not step.num_prefill_tokens and not step.num_decode_tokens \
                    and not self.num_running and self.scheduler.waiting:
                # Nothing runs and the head of the queue does not fit in a pool nobody in
                # this engine holds: the blocks are held elsewhere, and waiting would never
                # end.
                head = self.scheduler.waiting[0].request_id
                raise RuntimeError(
                    f"no progress: request {head!r} does not fit although no request of "
                    f"this engine holds blocks ({self.kv_manager.num_free_blocks} free of "
                    f"{self.kv_manager.block_pool.num_blocks - 1})")
            # The step's outputs of requests no call owns (a run call's own went to its
            # mailbox in _finish): this call's when it serves them, else kept for the next.
            unowned = [o for o in step.finished if o.request_id not in owned]
            (outputs if owner is None else self._unowned_finished).extend(unowned)
            return False

    # -- introspection ------------------------------------------------------------------

    def pool_usage(self) -> dict[str, Any]:
        """Blocks of the pool: total, free now, used now, peak used, cached (prefix cache)."""
        pool = self.kv_manager.block_pool
        return {"num_blocks": pool.num_blocks, "block_size": self.block_size,
                "free_blocks": pool.num_free_blocks, "used_blocks": pool.num_used_blocks,
                "peak_used_blocks": self.stats.peak_used_blocks,
                "peak_use": round(self.stats.peak_used_blocks / max(pool.num_blocks - 1, 1), 4),
                "cached_blocks": pool.num_cached_blocks,
                "cache_bytes": self.model.cache_bytes,
                "kv_cache_dtype": self.config.cache.kv_cache_dtype,
                "bytes_per_token_per_layer": self.model.caches[0].format.bytes_per_token,
                "fp8_overflows": self.stats.fp8_overflows}

    def describe_kv_cache_groups(self) -> list[dict[str, Any]]:
        """The KV-cache groups: layers, spec, manager class, page size, and how many layers
        of each spec type (a sparse model's indexer keys share the latent layers' group)."""
        result = []
        for group, manager in zip(self.kv_cache_groups, self.kv_manager.managers, strict=True):
            spec = group.kv_cache_spec
            result.append({"layers": list(group.layer_names), "spec": type(spec).__name__,
                           "manager": type(manager).__name__, "block_size": group.block_size,
                           "head_size": getattr(spec, "head_size", None),
                           "dtype": str(getattr(spec, "dtype", "")).removeprefix("torch."),
                           "page_size_bytes": group.page_size_bytes,
                           "specs": dict(Counter(type(s).__name__ for s in group.layer_specs))})
        return result
