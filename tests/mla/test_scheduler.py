"""The scheduler alone (no model): decode first, budget, FCFS, lookahead slots, preemption of
the newest request, max_num_seqs, finish frees blocks."""

from __future__ import annotations

import pytest
import torch

from app.config import CacheConfig
from app.kvcache import KVCacheManager, KVCacheSpecBindings, MLAAttentionSpec
from app.mla.requests import Request
from app.mla.scheduler import RequestState, RequestStatus, Scheduler

BS = 4


def _manager(num_blocks: int) -> KVCacheManager:
    spec = MLAAttentionSpec.from_dims(block_size=BS, kv_lora_rank=8, qk_rope_head_dim=4,
                                      dtype=torch.float32)
    return KVCacheManager.from_specs({"layer": spec}, CacheConfig(block_size=BS,
                                                                  num_blocks=num_blocks),
                                     bindings=KVCacheSpecBindings())


def _state(manager: KVCacheManager, rid: str, prompt_len: int, seed: int = 0) -> RequestState:
    tokens = [(seed * 7919 + i) % 1000 for i in range(prompt_len)]
    return RequestState(request=Request(rid, tokens, max_new_tokens=64),
                        kv=manager.new_request(rid, tokens),
                        block_table=torch.zeros(64, dtype=torch.int32), arrival_time=0.0,
                        arrival_step=0)


def _complete(manager: KVCacheManager, out_prefill: tuple[tuple[RequestState, int, int], ...],
              decode: tuple[RequestState, ...] = ()) -> None:
    """Pretend the step ran: report the KV and sample one token where a request caught up."""
    for st, done, n in out_prefill:
        manager.cache_blocks(st.kv, done + n)
        if st.num_computed_tokens == st.num_tokens:
            st.kv.append_token_ids(1)
    for st in decode:
        manager.cache_blocks(st.kv, st.num_computed_tokens + 1)
        st.kv.append_token_ids(1)


def test_decode_first_then_chunked_prefill_in_the_budget() -> None:
    manager = _manager(64)
    sched = Scheduler(manager, max_num_batched_tokens=10, max_num_seqs=8)
    a, b = _state(manager, "a", 3, 1), _state(manager, "b", 4, 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request_id, d, n) for s, d, n in out.prefill] == [("a", 0, 3), ("b", 0, 4)]
    _complete(manager, out.prefill)
    sched.add(_state(manager, "c", 30, 3))
    out = sched.schedule()
    assert [s.request_id for s in out.decode] == ["a", "b"] and out.query_len == 1
    assert [(s.request_id, d, n) for s, d, n in out.prefill] == [("c", 0, 8)]   # 10 - 2
    # a's block table covers its tokens
    assert a.num_blocks == 1 and int(a.block_table[0]) > 0


def test_lookahead_slots_for_speculative_steps() -> None:
    manager = _manager(64)
    sched = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=8,
                      num_speculative_tokens=3)
    st = _state(manager, "a", 4)
    sched.add(st)
    _complete(manager, sched.schedule().prefill)        # 4 computed, 5 tokens
    out = sched.schedule()
    assert out.decode == (st,) and out.query_len == 4 and out.num_decode_tokens == 4
    assert st.num_blocks == 2                           # slots for 4 + 1 + 3 = 8 tokens


def test_the_newest_running_request_is_preempted_when_the_pool_is_full() -> None:
    manager = _manager(1 + 6)                          # 6 usable blocks
    sched = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=8)
    states = [_state(manager, rid, 8, i) for i, rid in enumerate("abc")]
    for st in states:
        sched.add(st)
    out = sched.schedule()                              # 2 blocks each: the pool is full
    assert len(out.prefill) == 3 and manager.num_free_blocks == 0
    _complete(manager, out.prefill)                     # each has 9 tokens: needs block 3
    out = sched.schedule()
    # a needs a block: c (newest) is preempted, which frees two; a and b then both fit
    assert out.preempted == ("c",)
    c = states[2]
    assert c.status is RequestStatus.WAITING and sched.waiting[0] is c
    assert c.num_preemptions == 1 and c.num_computed_tokens == 0 and c.num_blocks == 0
    assert not manager.holds("c")
    assert [s.request_id for s in out.decode] == ["a", "b"] and out.prefill == ()
    _complete(manager, (), out.decode)
    # a and b hold 3 blocks each; c (waiting, first in line) does not fit: nothing overtakes
    out = sched.schedule()
    assert [s.request_id for s in out.decode] == ["a", "b"] and out.prefill == ()


def test_waiting_requests_are_first_come_first_served_and_capped() -> None:
    manager = _manager(1 + 4)
    sched = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=8)
    big, small = _state(manager, "big", 20, 1), _state(manager, "small", 2, 2)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()                               # big needs 5 blocks: nobody runs
    assert out.is_empty and list(sched.waiting) == [big, small]
    capped = Scheduler(_manager(64), max_num_batched_tokens=64, max_num_seqs=1)
    for rid in "xy":
        capped.add(_state(capped.kv_manager, rid, 3))
    out = capped.schedule()
    assert [s.request_id for s, _, _ in out.prefill] == ["x"] and len(capped.waiting) == 1


def test_finish_frees_blocks_wherever_the_request_is() -> None:
    manager = _manager(64)
    sched = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = _state(manager, "a", 9), _state(manager, "b", 5)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    sched.finish(a)                                      # running
    sched.finish(b)                                      # waiting
    assert not sched.has_unfinished() and manager.block_pool.num_used_blocks == 0
    assert a.status is RequestStatus.FINISHED and b.status is RequestStatus.FINISHED


def test_bad_scheduler_settings() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(_manager(8), max_num_batched_tokens=0, max_num_seqs=1)
    with pytest.raises(ValueError, match="must fit one decode step"):
        Scheduler(_manager(8), max_num_batched_tokens=3, max_num_seqs=1,
                  num_speculative_tokens=3)


def test_kept_rows_are_views_until_the_request_finishes() -> None:
    """Issue 35: a step keeps each request's output rows as views (no copy per request and
    step); they are copied out once, at the end, each run of consecutive parts with one cat.
    A run again after a preemption replaces what the earlier run kept from its start on; rows
    never computed here (a prefix-cache hit) stay 0 with kind 0."""
    state = RequestState(request=Request("r", [1, 2, 3], max_new_tokens=8),
                         kv=None, block_table=torch.zeros(4, dtype=torch.int32),  # type: ignore[arg-type]
                         arrival_time=0.0, arrival_step=0)
    assert state.kept_outputs(5, 2, torch.float32, torch.device("cpu")) == (None, None)
    state.kept_rows = []
    step = torch.arange(20.0).view(10, 2)
    state.keep_rows(2, step[0:3], 1)          # rows 2..4 (0..1 hit the prefix cache)
    state.keep_rows(5, step[3:4], 2)          # row 5, decode
    state.keep_rows(4, step[5:7], 2)          # preempted, run again from row 4: rows 4..5
    state.keep_rows(6, step[7:8], 2)
    assert step.data_ptr() == state.kept_rows[0][1].data_ptr()   # views, not copies
    hidden, kinds = state.kept_outputs(7, 2, torch.float32, torch.device("cpu"))
    assert hidden is not None and kinds is not None and state.kept_rows is None
    want = torch.zeros(7, 2)
    want[2:4], want[4:6], want[6] = step[0:2], step[5:7], step[7]
    assert torch.equal(hidden, want)
    assert kinds.tolist() == [0, 0, 1, 1, 2, 2, 2]


def test_kept_views_are_merged_every_kept_views_steps() -> None:
    """A long request does not keep every step's output alive (each also holds other
    requests' rows): past ``KEPT_VIEWS`` views they are merged into one tensor of its own."""
    from app.mla.scheduler import KEPT_VIEWS

    state = RequestState(request=Request("r", [1], max_new_tokens=64),
                         kv=None, block_table=torch.zeros(4, dtype=torch.int32),  # type: ignore[arg-type]
                         arrival_time=0.0, arrival_step=0, kept_rows=[])
    steps = [torch.full((8, 2), float(i)) for i in range(KEPT_VIEWS + 5)]
    for i, step in enumerate(steps):
        state.keep_rows(i, step[3:4], 2)
    assert state.kept_rows is not None
    views = [part for part in state.kept_rows if not part[2]]
    assert len(views) <= KEPT_VIEWS and len(state.kept_rows) < len(steps)
    held = {part[1].untyped_storage().data_ptr() for part in state.kept_rows}
    assert steps[0].untyped_storage().data_ptr() not in held   # the first steps released
    hidden, kinds = state.kept_outputs(len(steps), 2, torch.float32, torch.device("cpu"))
    assert hidden is not None and kinds is not None
    assert hidden[:, 0].tolist() == [float(i) for i in range(len(steps))]
    assert set(kinds.tolist()) == {2}
