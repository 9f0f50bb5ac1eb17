"""TORCH_SDPA on CPU called from many threads at once (issue 12 item 1): every call returns
what a lone call returns, nothing raises, nothing crashes, on the native kernel and on the
aten path, with one backend per thread and with one backend shared by the threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from app.backends.cpu import pool as _native_pool
from app.backends.prefill.base import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend

HEADS, NOPE, ROPE, DV = 2, 32, 32, 64  # head dim 64 (q/k and v), as in the issue
CALLS = 600  # per thread; the whole test stays a few seconds on 2 cores


@pytest.fixture(autouse=True)
def four_torch_threads() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(4)  # more shares than cores: the pool is busy and resized
    yield
    torch.set_num_threads(old)


def backend(native: bool) -> TorchSDPABackend:
    be = TorchSDPABackend(num_heads=HEADS, scale=0.125, kv_lora_rank=512,
                          qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV)
    be.cpu_native_kernel = native  # type: ignore[misc]
    if native and be._native_kernel(torch.float32) is None:
        pytest.skip("the native CPU kernel is unavailable here")
    return be


def inputs(lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return (torch.randn(t, HEADS, NOPE + ROPE, generator=gen),
            torch.randn(t, HEADS, NOPE + ROPE, generator=gen),
            torch.randn(t, HEADS, DV, generator=gen))


def hammer(workers: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def run(work: Callable[[], None]) -> None:
        try:
            start.wait()
            work()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["native", "aten"])
def test_threads_with_their_own_backends_and_plans(native: bool) -> None:
    """The issue's case: each thread its own backend and plan (1 x 8 vs 3 x 8 tokens, and
    more), each calling run_prefill_new_tokens many times."""
    plans = [[8], [8, 8, 8], [5, 16], [8]]
    expected, workers = [], []
    for i, lens in enumerate(plans):
        be = backend(native)
        be.prepare_metadata(MLAPrefillMetadata.build(lens))
        q, k, v = inputs(lens, seed=i)
        expected.append(be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True))

        def work(be: TorchSDPABackend = be, q: torch.Tensor = q, k: torch.Tensor = k,
                 v: torch.Tensor = v, want: tuple[torch.Tensor, ...] = expected[-1]) -> None:
            for _ in range(CALLS):
                out, lse = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
                assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        workers.append(work)
    assert hammer(workers) == []


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["native", "aten"])
def test_threads_sharing_one_backend_for_one_step(native: bool) -> None:
    """An engine running several layers of one step at once on one backend instance: the
    new-token call and a context chunk (whose aten path pads v into a kept buffer)."""
    lens, chunk = [8, 24, 8], [40, 16, 30]
    be = backend(native)
    be.prepare_metadata(MLAPrefillMetadata.build(lens, [chunk]))
    layers = [(*inputs(lens, seed=10 + i)[:1], *inputs(chunk, seed=20 + i)[1:])
              for i in range(4)]
    new_tokens = [inputs(lens, seed=10 + i) for i in range(4)]
    expected_chunk = [be.run_prefill_context_chunk(0, q, k, v) for q, k, v in layers]
    expected_new = [be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
                    for q, k, v in new_tokens]

    def work_for(i: int) -> Callable[[], None]:
        def work() -> None:
            for n in range(CALLS):
                if (n + i) % 2:
                    out, lse = be.run_prefill_context_chunk(0, *layers[i])
                    want = expected_chunk[i]
                else:
                    out, lse = be.run_prefill_new_tokens(*new_tokens[i],
                                                         return_softmax_lse=True)
                    want = expected_new[i]
                assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        return work

    assert hammer([work_for(i) for i in range(len(layers))]) == []


def test_every_share_finishes_before_an_error_surfaces() -> None:
    """A failing share must not let run_shares return while the others still run."""
    done = []
    release = threading.Event()

    def slow() -> None:
        release.wait(5)
        done.append("slow")

    def fails() -> None:
        release.set()
        raise ZeroDivisionError("share failed")

    with pytest.raises(ZeroDivisionError, match="share failed"):
        _native_pool.run_shares([fails, slow, slow])
    assert done == ["slow", "slow"]


def test_an_interrupted_caller_still_waits_for_its_shares() -> None:
    done = []
    release = threading.Event()

    def slow() -> None:
        release.wait(5)
        done.append("slow")

    def interrupted() -> None:
        release.set()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _native_pool.run_shares([interrupted, slow])
    assert done == ["slow"]


def test_a_child_forked_while_the_pool_lock_is_held_runs_shares() -> None:
    import faulthandler
    import os

    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    _native_pool.run_shares([lambda: None, lambda: None])  # the parent's pool exists
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _native_pool._pool._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 3
            try:
                faulthandler.dump_traceback_later(20, exit=True)  # a deadlock fails, not hangs
                done: list[int] = []
                _native_pool.run_shares([lambda: done.append(0), lambda: done.append(1)])
                code = 0 if sorted(done) == [0, 1] else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0
