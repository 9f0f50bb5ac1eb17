"""Run the shares of one native kernel call on several threads, safely.

ctypes releases the GIL during a C call, so plain Python threads run C kernels in parallel.
:func:`run_shares` runs the first share on the calling thread and the others on one
process-wide pool, and guarantees:

- any number of threads may call it at once, each with its own shares (they queue on the
  pool); the pool is only ever grown, never shut down under a caller (a replaced pool's
  threads exit once nobody holds it);
- it returns or raises only after every share it submitted has finished, even when a share
  fails, submitting fails, or the caller is interrupted (``KeyboardInterrupt``): kernel work
  never outlives the tensors it writes;
- a forked child starts with no pool (its copy of the parent's has no threads) and makes one.

A share must not call :func:`run_shares` itself (it could wait on work queued behind it), and
must not run torch ops that may parallelise: torch forbids its OpenMP pool from these threads
in a forked child ("Invalid thread pool").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

__all__ = ["run_shares"]


class _Pool:
    """The process's worker pool, grown to the largest number of workers asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._size = 0

    def executor(self, workers: int) -> ThreadPoolExecutor:
        """A pool with at least ``workers`` threads. A smaller one is replaced but never shut
        down: callers holding it finish normally, then its idle threads exit."""
        with self._lock:
            if self._executor is None or self._size < workers:
                self._executor = ThreadPoolExecutor(workers, thread_name_prefix="app-native")
                self._size = workers
            return self._executor


_pool = _Pool()


def _after_fork_in_child() -> None:
    global _pool
    _pool = _Pool()  # the parent's pool has no threads here, and its lock may be held


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_all(futures: Sequence[Future[None]]) -> None:
    """Wait for every future, even through an interrupt (re-raised once all are done)."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # the shares still write into the caller's tensors
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def run_shares(shares: Sequence[Callable[[], None]]) -> None:
    """Run every share (the first on this thread); return once all are done, raising the
    first error (this thread's share's first, then the pool's in order)."""
    if not shares:
        return
    if len(shares) == 1:
        shares[0]()
        return
    executor = _pool.executor(len(shares) - 1)
    futures: list[Future[None]] = []
    try:
        for share in shares[1:]:
            futures.append(executor.submit(share))
        shares[0]()
    finally:
        _wait_all(futures)
    for future in futures:
        future.result()
