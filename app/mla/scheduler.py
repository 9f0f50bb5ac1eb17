"""Continuous batching in the style of vLLM v1: decode first, then chunked prefill, one budget.

A request's progress is one number, ``num_computed_tokens`` (tokens whose KV is in the cache),
against its tokens so far (prompt, then generated). A running request with exactly one token
left to compute (its last sampled token) *decodes*; one with more is a *partial prefill*.
Each ``schedule()``:

1. gives every running decoding request its decode tokens, in admission order, while the token
   budget (``max_num_batched_tokens``) lasts: its last token plus ``num_speculative_tokens``
   drafts (a uniform ``query_len = 1 + k``); slots come from ``allocate_slots`` with the drafts
   as lookahead. When the pool cannot fit one, the *newest* running request is preempted (its
   blocks freed, back to the front of the queue, recomputed later from its prompt and the
   tokens it generated, through the prefix cache) until it fits, or it is the one preempted;
2. fills the rest of the budget with chunked prefill: partial prefills first, then waiting
   requests in arrival order (FCFS: one that does not fit stops admission). A new request first
   looks up the prefix cache (``get_computed_blocks``) and skips the tokens it hits;
3. if nothing could be scheduled while requests hold blocks, preempts the newest one and
   tries again (blocks freed elsewhere never deadlock the engine).

The engine runs the step and reports progress (``KVCacheManager.cache_blocks``: full blocks,
generated tokens included, become prefix-cache hits). Rejected drafts are rolled back by not
counting them: their slots lie past ``num_computed_tokens`` and are overwritten by the next
step. ``finish`` and ``abort`` free a request's blocks. Not thread-safe: one engine thread
drives it.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterator

import attrs
import torch

from app._validation import check_int_at_least
from app.kvcache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from app.kvcache.request import KVCacheRequest
from app.mla.requests import Request
from app.mla.speculative import NgramIndex
from app.model.sparse.selections import selection_bytes

__all__ = ["KEPT_VIEWS", "RequestState", "RequestStatus", "Scheduler", "SchedulerOutput"]


#: Output rows a request keeps as views of the steps' outputs before merging them into one
#: tensor of its own (``RequestState.keep_rows``): bounds what finished requests' rows the
#: step tensors they share keep alive, at one copy per request every this many steps.
KEPT_VIEWS = 16


def _merged(parts: list[tuple[int, torch.Tensor, bool]]) -> list[tuple[int, torch.Tensor]]:
    """``(start, rows)`` per run of consecutive parts, each run's rows in one tensor."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    end = -1
    for first, rows, _ in parts:
        if runs and first == end:
            runs[-1][1].append(rows)
        else:
            runs.append((first, [rows]))
        end = first + int(rows.shape[0])
    return [(first, torch.cat(rows) if len(rows) > 1 else rows[0]) for first, rows in runs]


class RequestStatus(enum.Enum):
    """Where a request is: waiting (new or preempted), running (holds blocks), finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class RequestState:
    """The engine's state of one request.

    ``kv`` holds the token ids (prompt, then generated) and ``num_computed_tokens``;
    ``block_table`` int32 ``[capacity]`` the block ids of the KV-cache group (the first
    ``num_blocks`` valid); ``kept_rows`` / ``kept_kinds`` the outputs kept so far when the
    engine keeps them (``keep_rows``: views of the steps' outputs, merged every
    ``KEPT_VIEWS`` steps and copied out by ``kept_outputs`` when the request finishes);
    ``hidden``/``row_kinds`` the kept outputs (``RequestOutput``); ``kept_selections`` a
    sparse model's selections (bitmasks) of the rows computed, as ``(first row, [indexer
    layers, rows, bytes])`` parts, when the engine keeps them (``keep_selection_rows``; None
    otherwise).
    """

    request: Request
    kv: KVCacheRequest
    block_table: torch.Tensor
    arrival_time: float
    arrival_step: int
    status: RequestStatus = RequestStatus.WAITING
    num_blocks: int = 0
    output_token_ids: list[int] = attrs.field(factory=list)
    logit_margins: list[float] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_token_time: float | None = None
    first_token_step: int | None = None
    ngram_index: NgramIndex | None = None
    drafts: list[int] = attrs.field(factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    hidden: torch.Tensor | None = None
    row_kinds: torch.Tensor | None = None
    kept_rows: list[tuple[int, torch.Tensor, bool]] | None = None
    kept_kinds: list[int] = attrs.field(factory=list)
    kept_selections: list[tuple[int, torch.Tensor]] | None = None

    def keep_selection_rows(self, start: int, chosen: torch.Tensor | None, first: int,
                            n: int) -> None:
        """Keep rows ``first..first + n`` of a step's selections ``chosen [indexer layers, T,
        bytes]`` (uint8 bitmasks on the CPU, ``app.model.sparse.selections``) as this
        request's rows ``start..start + n``, each cut to the positions those rows can see
        (``ceil((start + n) / 8)`` bytes); nothing unless ``kept_selections`` is a list."""
        if self.kept_selections is None or chosen is None or not n:
            return
        kept = self.kept_selections
        while kept and kept[-1][0] >= start:   # run again after a preemption
            kept.pop()
        kept.append((start, chosen[:, first:first + n, :selection_bytes(start + n)].clone()))

    def kept_selection_bits(self, layers: int, total: int) -> torch.Tensor | None:
        """The kept selections as ``[layers, total, ceil(total / 8)]`` uint8 bitmasks (all
        zero where none was kept; a later run of a row, after a preemption, over an earlier
        one), None when none are kept. Releases them."""
        kept, self.kept_selections = self.kept_selections, None
        if kept is None:
            return None
        out = torch.zeros(layers, total, selection_bytes(total), dtype=torch.uint8)
        for start, part in kept:
            n = max(0, min(int(part.shape[1]), total - start))
            out[:, start:start + n, :part.shape[2]] = part[:, :n]
        return out

    def keep_rows(self, start: int, rows: torch.Tensor, kind: int) -> None:
        """Keep ``rows`` (a step's output rows; a view, not copied: a step costs no copy per
        request) as this request's output rows from ``start`` on, over whatever an earlier run
        (before a preemption) kept there; nothing unless ``kept_rows`` is a list. Every
        ``KEPT_VIEWS`` views are merged into one tensor of the request's own (one copy), so a
        request never holds more than that many steps' outputs alive."""
        kept = self.kept_rows
        if kept is None or not rows.shape[0]:
            return
        while kept and kept[-1][0] >= start:
            kept.pop()
        if kept and kept[-1][0] + kept[-1][1].shape[0] > start:
            first, old, owned = kept[-1]
            kept[-1] = (first, old[:start - first], owned)
        kept.append((start, rows, False))
        kinds = self.kept_kinds
        del kinds[start:]
        kinds.extend([0] * (start - len(kinds)))
        kinds.extend([int(kind)] * int(rows.shape[0]))
        views = [i for i, part in enumerate(kept) if not part[2]]
        if len(views) > KEPT_VIEWS:
            tail = _merged(kept[views[0]:])
            kept[views[0]:] = [(first, part, True) for first, part in tail]

    def kept_outputs(self, total: int, width: int, dtype: torch.dtype, device: torch.device
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The kept rows as ``hidden [total, width]`` and their int8 ``row_kinds`` (0: never
        computed for this request, e.g. a prefix-cache hit), each run of consecutive parts
        copied with one ``cat``; ``(None, None)`` when nothing is kept. Releases the parts."""
        kept, self.kept_rows = self.kept_rows, None
        if kept is None:
            return None, None
        hidden = torch.zeros(total, width, dtype=dtype, device=device)
        for first, rows in _merged(kept):
            n = max(0, min(int(rows.shape[0]), total - first))
            hidden[first:first + n] = rows[:n]
        kinds = self.kept_kinds[:total]
        kinds += [0] * (total - len(kinds))
        self.kept_kinds = []
        return hidden, torch.tensor(kinds, dtype=torch.int8)

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.kv.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache."""
        return self.kv.num_computed_tokens

    def append_blocks(self, block_ids: list[int]) -> None:
        """Record blocks just allocated (appended to the block table)."""
        n = len(block_ids)
        if n:
            self.block_table[self.num_blocks:self.num_blocks + n] = torch.tensor(
                block_ids, dtype=torch.int32)
            self.num_blocks += n


@attrs.frozen(eq=False)
class SchedulerOutput:
    """One step's work: ``decode`` requests (each computes ``query_len`` tokens: its last token
    and its drafts), ``prefill`` as ``(request, context tokens, new tokens)``, and the ids of
    the requests preempted while scheduling."""

    decode: tuple[RequestState, ...]
    query_len: int
    prefill: tuple[tuple[RequestState, int, int], ...]
    preempted: tuple[str, ...]

    @property
    def num_decode_tokens(self) -> int:
        """Query tokens of the decode batch (drafts included)."""
        return len(self.decode) * self.query_len

    @property
    def num_prefill_tokens(self) -> int:
        """New tokens of the prefill batch."""
        return sum(n for _, _, n in self.prefill)

    @property
    def is_empty(self) -> bool:
        """Nothing was scheduled."""
        return not self.decode and not self.prefill


class Scheduler:
    """Queue, running set, token budget and preemption over a ``KVCacheManager``."""

    def __init__(self, kv_manager: KVCacheManager, *, max_num_batched_tokens: int,
                 max_num_seqs: int, num_speculative_tokens: int = 0) -> None:
        check_int_at_least("Scheduler: max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int_at_least("Scheduler: max_num_seqs", max_num_seqs, 1)
        check_int_at_least("Scheduler: num_speculative_tokens", num_speculative_tokens, 0)
        if max_num_batched_tokens < 1 + num_speculative_tokens:
            raise ValueError(f"Scheduler: max_num_batched_tokens ({max_num_batched_tokens}) "
                             f"must fit one decode step of 1 + {num_speculative_tokens} tokens")
        self.kv_manager = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0

    def __iter__(self) -> Iterator[RequestState]:
        yield from self.running
        yield from self.waiting

    def add(self, state: RequestState) -> None:
        """Queue a new request (at the back)."""
        state.status = RequestStatus.WAITING
        self.waiting.append(state)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    # -- leaving -------------------------------------------------------------------------

    def finish(self, state: RequestState) -> None:
        """Take a request out (finished or aborted) and free every block it holds."""
        if state.status is RequestStatus.RUNNING:
            self.running.remove(state)
        elif state.status is RequestStatus.WAITING:
            self.waiting.remove(state)
        self.kv_manager.free(state.kv)
        state.num_blocks = 0
        state.status = RequestStatus.FINISHED

    def _preempt(self, victim: RequestState) -> None:
        self.running.remove(victim)
        self.kv_manager.free(victim.kv)
        victim.num_blocks = 0
        victim.num_preemptions += 1
        victim.drafts = []
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    # -- scheduling -----------------------------------------------------------------------

    def _allocate(self, state: RequestState, num_new: int, lookahead: int = 0) -> bool:
        blocks = self.kv_manager.allocate_slots(state.kv, num_new,
                                                num_lookahead_tokens=lookahead)
        if blocks is None:
            return False
        self._record(state, blocks)
        return True

    @staticmethod
    def _record(state: RequestState, blocks: KVCacheBlocks) -> None:
        if blocks.num_blocks:
            state.append_blocks([b.block_id for b in blocks.blocks[0]])

    def schedule(self) -> SchedulerOutput:
        """The next step's work (see the module docstring)."""
        preempted: list[str] = []
        while True:
            out = self._schedule_once(preempted)
            if not out.is_empty or not self.running:
                return out
            # Everything running is stuck on blocks the pool cannot give: free the newest.
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _schedule_once(self, preempted: list[str]) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        query_len = 1 + self.num_speculative_tokens
        scheduled: set[int] = set()
        decode: list[RequestState] = []
        # 1. decode tokens of every running request that has only its last token to compute.
        i = 0
        while i < len(self.running):
            state = self.running[i]
            if state.num_tokens - state.num_computed_tokens != 1:
                i += 1
                continue
            if budget < query_len:
                break
            while not self._allocate(state, 1, self.num_speculative_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is state:
                    break
            if state.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the newest, nobody after it runs
            decode.append(state)
            scheduled.add(id(state))
            budget -= query_len
            i += 1
        prefill: list[tuple[RequestState, int, int]] = []
        # 2a. partial prefills (running, more than one token to compute).
        for state in list(self.running):
            if budget == 0:
                break
            if id(state) in scheduled or state.status is not RequestStatus.RUNNING:
                continue
            done = state.num_computed_tokens
            if state.num_tokens - done <= 1:
                continue  # a decoding request that did not fit the budget
            n = min(state.num_tokens - done, budget)
            while not self._allocate(state, n):
                victims = [r for r in self.running
                           if id(r) not in scheduled and r is not state]
                if not victims:
                    break
                self._preempt(victims[-1])
                preempted.append(victims[-1].request_id)
            else:
                prefill.append((state, done, n))
                scheduled.add(id(state))
                budget -= n
        # 2b. waiting requests, first come first served.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            state = self.waiting[0]
            hit = self.kv_manager.get_computed_blocks(state.kv)
            n = min(state.num_tokens - hit.num_computed_tokens, budget)
            blocks = self.kv_manager.allocate_slots(state.kv, n, hit)
            if blocks is None:
                break
            self.waiting.popleft()
            if hit.num_computed_tokens:
                state.append_blocks(hit.get_block_ids()[0])
            self._record(state, blocks)
            if state.num_cached_tokens < 0:
                state.num_cached_tokens = hit.num_computed_tokens
            state.status = RequestStatus.RUNNING
            self.running.append(state)
            prefill.append((state, state.num_computed_tokens, n))
            scheduled.add(id(state))
            budget -= n
        return SchedulerOutput(decode=tuple(decode), query_len=query_len,
                               prefill=tuple(prefill), preempted=tuple(preempted))
