"""Synthetic workloads: requests of random tokens with shared prefixes, from a seed.

A workload has ``num_prefixes`` shared "documents" (think system prompts or few-shot examples).
Request lengths are log-uniform in ``[min_len, max_len]``; most requests start with a prefix of
one document (so later requests hit the prefix cache), the rest are unrelated random tokens.
Each request asks for ``min_new_tokens..max_new_tokens`` generated tokens (uniform).
"""

from __future__ import annotations

import math
import random

import attrs

from app._validation import check_int_at_least

__all__ = ["WorkloadRequest", "make_workload"]


@attrs.frozen
class WorkloadRequest:
    """One request: its id, prompt token ids, how many leading tokens it shares with its group,
    and how many tokens to generate."""

    request_id: str
    token_ids: tuple[int, ...]
    prefix_group: int | None
    shared_prefix_len: int
    max_new_tokens: int = 1


def make_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0,
                  num_prefixes: int = 4, shared_fraction: float = 0.9, *,
                  min_new_tokens: int = 1, max_new_tokens: int = 1) -> list[WorkloadRequest]:
    """``num_requests`` requests of ``min_len..max_len`` tokens in ``[0, vocab_size)``.

    Lengths are log-uniform, stratified: one request per ``1 / num_requests`` quantile band.

    Each prefix group's shared length is drawn in ``[max_len // 4, 3 * max_len // 4]``; a request of
    a group shares ``min(shared_len, its length - 1)`` leading tokens with the group. About
    ``shared_fraction`` of the requests belong to a group. New-token counts come from their own
    seeded stream, so the prompts do not depend on them. Deterministic for a seed.
    """
    for name, value, low in (("num_requests", num_requests, 1), ("min_len", min_len, 1),
                             ("max_len", max_len, 1), ("vocab_size", vocab_size, 1),
                             ("num_prefixes", num_prefixes, 0),
                             ("min_new_tokens", min_new_tokens, 1),
                             ("max_new_tokens", max_new_tokens, 1)):
        check_int_at_least(f"make_workload: {name}", value, low)
    if min_len > max_len:
        raise ValueError(f"make_workload: min_len ({min_len}) > max_len ({max_len})")
    if min_new_tokens > max_new_tokens:
        raise ValueError(f"make_workload: min_new_tokens ({min_new_tokens}) > max_new_tokens "
                         f"({max_new_tokens})")
    new_rng = random.Random(seed + 0x4E3)
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError(f"make_workload: shared_fraction must be in [0, 1], "
                         f"got {shared_fraction!r}")
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab_size) for _ in range(max_len)] for _ in range(num_prefixes)]
    doc_shared = [rng.randint(max(1, max_len // 4), max(1, (3 * max_len) // 4))
                  for _ in range(num_prefixes)]
    log_lo, log_hi = math.log(min_len), math.log(max_len)
    # Stratified log-uniform lengths (one per 1/n quantile band, jittered, shuffled): every
    # seed gets the same spread of lengths, so the cost of a workload hardly depends on it.
    bands = [(i + rng.random()) / num_requests for i in range(num_requests)]
    rng.shuffle(bands)
    requests = []
    for i, band in enumerate(bands):
        length = min(max_len, max(min_len, round(math.exp(log_lo + band * (log_hi - log_lo)))))
        group: int | None = None
        shared = 0
        if num_prefixes and rng.random() < shared_fraction:
            group = rng.randrange(num_prefixes)
            shared = min(doc_shared[group], length - 1)
        tokens = docs[group][:shared] if group is not None else []
        tokens += [rng.randrange(vocab_size) for _ in range(length - shared)]
        requests.append(WorkloadRequest(
            request_id=f"req-{i}", token_ids=tuple(tokens), prefix_group=group,
            shared_prefix_len=shared,
            max_new_tokens=new_rng.randint(min_new_tokens, max_new_tokens)))
    return requests
