"""What a decode step may emit when some of its rows are not finite.

A decode step runs ``query_len = 1 + k`` rows per request: the last token, then the ``k``
drafts; row ``i``'s greedy token is the model's choice after drafts ``< i``, and verification
emits ``drafts[:j] + [greedy[j]]`` (``app.mla.speculative.accept_greedy``), which reads rows
``0..j`` only. A row is *non-finite* when its log-probability is (a NaN or infinite logit).

``verify_rows`` keeps the plain greedy run's output whatever the rows after the first
non-finite one hold: when a draft before that row is rejected, the non-finite row belongs to a
continuation that is thrown away, and the step emits as usual; when every draft before it is
accepted, the step emits those drafts (each the greedy token of a finite row) and the request
needs the non-finite row next: it ends with ``FinishReason.ERROR``, exactly where the plain
run would have stopped. No token of a row at or after the first non-finite one is emitted.

That reading needs rows that are finite to be right and rows before a poisoned key to stay
finite: a decode backend that declares ``isolates_nonfinite_keys = False`` may turn every row
of the request non-finite (``app.backends.decode.base``). For such a backend the engine runs the
flagged requests' rows again one row per request (``one_row_per_request``: ``query_len`` 1,
each row a request of its own whose length ends at its own token, so a key after it is past its
length and changes nothing on any backend) and decides from that run. It costs nothing unless a
row is non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import torch

from app.backends.decode.base import MLADecodeBackend
from app.mla.speculative import accept_greedy
from app.model.model import DeepseekModel, GreedyChoice, Watch

__all__ = ["RowsVerdict", "decode_error", "decode_rows_alone", "first_nonfinite_rows",
           "locate_error",
           "non_finite_rows", "one_row_per_request", "recheck_rows_alone", "trusted_rows",
           "verify_rows"]


def non_finite_rows(model: DeepseekModel, step: int, choice: GreedyChoice,
                    rerun: Callable[[Watch], torch.Tensor]) -> dict[int, str]:
    """The rows of ``choice`` whose logits were not finite (a NaN or +inf logit makes the
    row's log-probability NaN or infinite), each with the error to report; empty when all are
    finite (the only cost on the hot path). ``rerun(watch)`` runs the step (the engine's
    ``step``-th) again to find the first stage that produced the non-finite value."""
    rows = [i for i, logprob in enumerate(choice.logprobs) if not math.isfinite(logprob)]
    if not rows:
        return {}
    return dict.fromkeys(rows, locate_error(model, step, rerun))


def decode_error(model: DeepseekModel, step: int, tables: Sequence[torch.Tensor],
                 dones: Sequence[int], ids: Sequence[int], query_len: int,
                 failing: Sequence[int]) -> str:
    """``locate_error`` of a decode step whose requests ``failing`` (batch indices) need a
    non-finite row, their rows run again alone (``decode_rows_alone``)."""
    return locate_error(model, step, lambda watch: decode_rows_alone(
        model, tables, dones, ids, query_len, watch, only=failing))


def locate_error(model: DeepseekModel, step: int, rerun: Callable[[Watch], torch.Tensor]
                 ) -> str:
    """The error naming the first non-finite stage when ``rerun(watch)`` reruns the engine's
    ``step``-th step."""
    where = model.locate_non_finite(rerun)
    return (f"the model's logits are not finite (NaN or infinite) in step {step}; the first "
            f"stage that produced a non-finite value: {where}")


@attrs.frozen
class RowsVerdict:
    """One request's share of a decode step: ``accepted`` drafts, the ``tokens`` to emit, and
    ``error``: the request needs a non-finite row after those tokens (it ends with
    ``FinishReason.ERROR`` unless the tokens already finish it)."""

    accepted: int
    tokens: list[int]
    error: bool


def first_nonfinite_rows(logprobs: Sequence[float], batch: int, query_len: int
                         ) -> list[int | None]:
    """Per request of a step (``batch`` requests, ``query_len`` rows each, request-major
    ``logprobs``): the index of its first row whose log-probability is not finite, or None."""
    firsts: list[int | None] = []
    for b in range(batch):
        rows = logprobs[b * query_len:(b + 1) * query_len]
        firsts.append(next((i for i, lp in enumerate(rows) if not math.isfinite(lp)), None))
    return firsts


def verify_rows(drafts: Sequence[int], greedy: Sequence[int], first_bad: int | None
                ) -> RowsVerdict:
    """Greedy verification of ``drafts`` (``k``) against ``greedy`` (``k + 1`` rows) that reads
    no row at or after ``first_bad`` (the first non-finite row; None: all are finite)."""
    if first_bad is None:
        accepted, tokens = accept_greedy(drafts, greedy)
        return RowsVerdict(accepted, tokens, False)
    j = 0
    while j < first_bad and drafts[j] == greedy[j]:
        j += 1
    if j < first_bad:   # a draft before the bad row is rejected: rows 0..j decide
        return RowsVerdict(j, [*drafts[:j], greedy[j]], False)
    return RowsVerdict(first_bad, list(drafts[:first_bad]), True)


def one_row_per_request(block_tables: Sequence[torch.Tensor], num_computed: Sequence[int],
                        token_ids: Sequence[int], query_len: int
                        ) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
    """A step's rows as a step of ``query_len`` 1: row ``i`` of request ``b`` becomes a request
    with ``num_computed[b] + i`` tokens before it (same block table, same slot), in the same
    order. Returns the block tables, the computed counts and the token ids (int64) for
    ``DeepseekModel.plan_decode`` / ``decode``."""
    tables = [table for table in block_tables for _ in range(query_len)]
    computed = [n + i for n in num_computed for i in range(query_len)]
    if len(token_ids) != len(tables):
        raise ValueError(f"one_row_per_request: {len(token_ids)} token ids for "
                         f"{len(block_tables)} requests of {query_len} rows")
    return tables, computed, torch.tensor(list(token_ids), dtype=torch.int64)


def decode_rows_alone(model: DeepseekModel, block_tables: Sequence[torch.Tensor],
                      num_computed: Sequence[int], token_ids: Sequence[int], query_len: int,
                      watch: Watch | None = None, *, only: Sequence[int] | None = None
                      ) -> torch.Tensor:
    """A decode step's ``query_len`` rows per request (request-major ``token_ids``) run one
    row per request (``one_row_per_request``), of the requests ``only`` lists (default: all);
    the final hidden states ``[len(only) * query_len, D]``, in order."""
    q = query_len
    picked = range(len(block_tables)) if only is None else only
    tables, computed, ids = one_row_per_request(
        [block_tables[b] for b in picked], [num_computed[b] for b in picked],
        [token_ids[b * q + i] for b in picked for i in range(q)], q)
    return model.decode(ids, model.plan_decode(tables, computed, 1, pad=False), watch=watch)


def trusted_rows(model: DeepseekModel, backend: type[MLADecodeBackend],
                 block_tables: Sequence[torch.Tensor], num_computed: Sequence[int],
                 token_ids: Sequence[int], query_len: int, hidden: torch.Tensor,
                 choice: GreedyChoice) -> tuple[torch.Tensor, GreedyChoice, list[int | None]]:
    """A decode step's ``hidden`` and ``choice`` as far as they can be trusted, and each
    request's first non-finite row (None: all finite): as they are, unless the step has
    several rows per request, a non-finite row, and a ``backend`` that does not isolate
    non-finite keys; then those requests' rows come from ``recheck_rows_alone``."""
    first_bad = first_nonfinite_rows(choice.logprobs, len(block_tables), query_len)
    if query_len == 1 or backend.isolates_nonfinite_keys \
            or all(r is None for r in first_bad):
        return hidden, choice, first_bad
    return recheck_rows_alone(model, block_tables, num_computed, token_ids, query_len, hidden,
                              choice, first_bad)


def recheck_rows_alone(model: DeepseekModel, block_tables: Sequence[torch.Tensor],
                       num_computed: Sequence[int], token_ids: Sequence[int], query_len: int,
                       hidden: torch.Tensor, choice: GreedyChoice,
                       first_bad: Sequence[int | None]
                       ) -> tuple[torch.Tensor, GreedyChoice, list[int | None]]:
    """A step's ``hidden`` rows and greedy ``choice`` with the requests that have a non-finite
    row (``first_bad`` not None) run again one row per request (``decode_rows_alone``): what
    a decode backend that does not isolate non-finite keys computes right. Returns the
    updated ``hidden``, ``choice`` and first non-finite rows."""
    q = query_len
    flagged = [b for b, r in enumerate(first_bad) if r is not None]
    rows = [b * q + i for b in flagged for i in range(q)]
    again = decode_rows_alone(model, block_tables, num_computed, token_ids, q, only=flagged)
    redo = model.greedy(again)
    index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
    hidden = hidden.index_copy(0, index, again.to(hidden.dtype))
    tokens, margins = list(choice.tokens), list(choice.margins)
    logprobs = list(choice.logprobs)
    for n, r in enumerate(rows):
        tokens[r], margins[r], logprobs[r] = redo.tokens[n], redo.margins[n], redo.logprobs[n]
    updated = GreedyChoice(tokens, margins, logprobs)
    return hidden, updated, first_nonfinite_rows(logprobs, len(first_bad), q)
