"""Per-thread float32 scratch for the native CPU kernels (prefill and decode alike).

A kernel call hands each of its shares a scratch buffer (packed queries, accumulators). Fresh
pages cost page faults on every call, so each thread keeps its largest buffer for the next call,
up to ``keep_bytes`` (a larger one is made for the call and dropped after it). The caller holds
the returned tensor by name until its C call returns: the buffer kept here may be replaced by a
later, larger request on the same thread, never while a call of that thread runs.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["thread_scratch"]

_local = threading.local()


def thread_scratch(floats: int, keep_bytes: int) -> torch.Tensor:
    """This thread's scratch of at least ``floats`` float32s, kept between calls when it is
    at most ``keep_bytes``."""
    buf: torch.Tensor | None = getattr(_local, "buf", None)
    if buf is not None and buf.numel() >= floats:
        return buf
    buf = torch.empty(floats, dtype=torch.float32)
    _local.buf = buf if floats * 4 <= keep_bytes else None
    return buf
