"""Teacher-forced checks of generated requests against the dense float64 model.

A finished request's final sequence (prompt + generated tokens) is run through
``app.model.ReferenceModel`` (float64, keys and values up-projected, a causal softmax, no cache,
no chunks, no backend) and compared, row by row, with the final normed hidden states the engine
produced: prefill rows (the prefill backend) and decode rows (the absorbed decode backend) are
reported separately. The LM head then checks the tokens: each generated token must be the
float64 argmax of the row that chose it, unless the float64 gap between the two candidates is
within what the engine's own row error moves them (a *near-tie*: rounding may pick either); a
flip beyond that means a token came from the wrong row or a wrong logit.

Rows whose routing margin (``ReferenceModel``: the gap between the last expert or group chosen
and the first left out, in any MoE layer) is within the engine dtype's rounding
(``ROUTING_TOLERANCES``) may legitimately take other experts: they are counted as routing
near-ties and left out of the error and the token check.

A sparse model's outputs that carry the engine's own selections (``RequestOutput.selections``:
``MLAEngine(keep_selections=True)``) are checked with them: the float64 reference (and the
dense model in the engine's dtype, which sets the tolerance) attend to the positions the engine
selected, so every row is compared at the dense model's tolerance (a wrong attention output in
a sparse layer fails as it would in a dense one), and the selections are compared apart: per
row and layer with an indexer, the keys both selected (``selection_overlap``) and, where they
differ, how far the engine's selection is from one the float64 scores allow (its *violation*,
relative to the row's largest score: ``app.model.sparse.reference.compare_selection``). A
difference within ``SELECTION_TOLERANCES`` of the dtype is a selection near-tie (rounding), one
beyond it a selection mismatch, which fails the check. Without them (an engine that did not
keep them), rows whose float64 top-k is that near a tie in any layer (the selection margin) may
attend to another key and are left out of the comparison (``selection_near_ties``).

The tolerance follows the dtype (``derived_tolerance``): the same dense model computed plainly in
the engine's dtype (``ReferenceModel(weights, dtype)``, as transformers computes it; with an
FP8 latent cache, ``ReferenceModel(weights, dtype, kv_cache_dtype=...)``, its keys and values
through that cache as the engine writes it: e4m3's 2^-4 is measured, not guessed) is
compared with float64 on the same rows (``check_generations(..., dtype_reference=...)``), and the
engine may be ``DTYPE_ERROR_FACTOR`` times that far, never held below the dtype's few units of
rounding (``REFERENCE_TOLERANCES``): a model whose own rounding in its dtype is large (a random
checkpoint with a large LM-head gain, a deep bf16 model) is not failed for it, and an engine
twice as far from float64 as the plain computation in its dtype still is.

Rows checked (``sample_rows``), per request: at most ``max_prefill_rows`` prefill rows (the
last ``tail_rows`` always) and at most ``max_decode_rows`` decode rows (the first and the last
``edge_rows`` always), the others at a stride; ``None`` checks every row of that kind. Keys
and values are needed for every token, so the reference reuses them along the longest common
prefix with the sequence it checked before: check requests sorted by their tokens and a shared
prompt prefix is computed once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from app.mla.requests import RequestOutput, RowKind
from app.model.reference import (
    ROUTING_TOLERANCES,
    SELECTION_TOLERANCES,
    ReferenceModel,
    ReferenceRows,
    reference_tolerance,
    routing_tolerance,
)

__all__ = ["DTYPE_ERROR_FACTOR", "GenerationCheck", "check_generation", "check_generations",
           "derived_tolerance", "sample_rows", "selection_limit", "tolerance_rule"]

#: How many times the error of the plain dense model in the engine's dtype (against float64,
#: on the same rows) the engine's own error may be.
DTYPE_ERROR_FACTOR = 2.0


def derived_tolerance(dtype: torch.dtype, dtype_relative_error: float) -> float:
    """The relative error accepted from an engine computing in ``dtype``:
    ``max(REFERENCE_TOLERANCES[dtype], DTYPE_ERROR_FACTOR * dtype_relative_error)``, where
    ``dtype_relative_error`` is the measured error of the dense model computed in ``dtype`` on
    the rows checked (``GenerationCheck.dtype_relative_error``); ``ValueError`` for a dtype
    without a floor. A non-finite measurement gives the floor (a NaN must not widen it)."""
    floor = reference_tolerance(dtype)
    if not math.isfinite(dtype_relative_error):
        return floor
    return max(floor, DTYPE_ERROR_FACTOR * dtype_relative_error)


#: How many times the outputs' tolerance an index score may move: a score is the product of
#: a query and a key, each computed from hidden states that may be off by the tolerance.
SELECTION_ERROR_FACTOR = 2.0


def selection_limit(dtype: torch.dtype, tolerance: float) -> float:
    """The largest violation of an engine's selection (``GenerationCheck.selection_violations``)
    that rounding explains: ``max(SELECTION_TOLERANCES[dtype], 2 x tolerance)`` with
    ``tolerance`` the relative error accepted in the outputs (``derived_tolerance``): the
    float64 index scores, relative to the row's largest, may move as far as a product of two
    factors each within the tolerance (an FP8 latent cache moved the hidden states of a tiny
    GLM-5 by 9% and a selection by 0.29 of its row's largest score; a dropped key is inf)."""
    return max(SELECTION_TOLERANCES.get(dtype, 0.0), SELECTION_ERROR_FACTOR * tolerance)


def tolerance_rule(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """``derived_tolerance``'s rule in words, for a report; with an FP8 ``kv_cache_dtype`` the
    dense model measured passes its keys and values through that cache
    (``ReferenceModel(..., kv_cache_dtype=...)``): what the dtype and the cache cost."""
    name = str(dtype).removeprefix("torch.")
    cache = "" if kv_cache_dtype == "auto" else (
        f" with its keys and values through the {kv_cache_dtype} cache")
    return (f"max({reference_tolerance(dtype):.0e}, {DTYPE_ERROR_FACTOR:g} x the relative error "
            f"of the same dense model computed in {name}{cache} against float64 on the rows "
            f"checked)")


def _strided(rows: torch.Tensor, head: int, tail: int, most: int | None) -> torch.Tensor:
    """``rows`` (sorted), or when more than ``most``: the first ``head``, the last ``tail`` and
    the rest filled at a stride."""
    n = rows.numel()
    if most is None or n <= most:
        return rows
    head, tail = min(head, most), min(tail, max(most - head, 0))
    body = rows[head:n - tail]
    room = most - head - tail
    stride = -(-body.numel() // room) if room > 0 else body.numel() + 1
    middle = body[::stride][:room] if room > 0 else body[:0]
    return torch.cat([rows[:head], middle, rows[n - tail:] if tail else rows[:0]])


def sample_rows(row_kinds: torch.Tensor, max_prefill_rows: int | None = 32,
                tail_rows: int = 16, max_decode_rows: int | None = 32,
                edge_rows: int = 8) -> torch.Tensor:
    """The rows to check (sorted int64): at most ``max_prefill_rows`` ``PREFILL`` rows (the last
    ``tail_rows`` of them always, the others at a stride) and at most ``max_decode_rows``
    ``DECODE`` rows (the first and the last ``edge_rows`` always: the first decode rows and the
    request's last rows, the others at a stride). ``None`` keeps every row of that kind."""
    kinds = row_kinds.to("cpu")
    decode = (kinds == int(RowKind.DECODE)).nonzero().flatten()
    prefill = (kinds == int(RowKind.PREFILL)).nonzero().flatten()
    rows: torch.Tensor = torch.unique(torch.cat([
        _strided(prefill, 0, tail_rows, max_prefill_rows),
        _strided(decode, edge_rows, edge_rows, max_decode_rows)]))
    return rows


@attrs.frozen
class GenerationCheck:
    """One request against the float64 reference: rows checked / computed per path, the
    largest absolute error per path, the reference's scale, the token verdicts, and the
    largest absolute error of the dense model computed in the engine's dtype on the same rows
    (``dtype_max_abs_error``; 0 when not measured), and a sparse model's rows left out for a
    top-k selection near a tie (``selection_near_ties``; only without the engine's
    selections). Given the engine's selections (see the module): the rows whose selections
    were compared, the keys the reference selected and how many of them the engine did too
    (summed over the indexer layers), and the violation of each row that selected otherwise
    (largest first; ``selection_mismatches``). ``dtype_route_differences``: rows where the
    dense model in the engine's dtype chose other experts than float64 in some MoE layer,
    left out of ``dtype_max_abs_error`` (a different expert is no measure of rounding)."""

    request_id: str
    prefill_rows_checked: int
    prefill_rows_computed: int
    decode_rows_checked: int
    decode_rows_computed: int
    prefill_max_abs_error: float
    decode_max_abs_error: float
    ref_max_abs: float
    tokens_checked: int
    tokens_agreeing: int
    near_ties: int
    token_mismatches: int
    routing_near_ties: int = 0
    dtype_max_abs_error: float = 0.0
    selection_near_ties: int = 0
    selection_rows_compared: int = 0
    selection_keys: int = 0
    selection_keys_shared: int = 0
    selection_violations: tuple[float, ...] = ()
    dtype_route_differences: int = 0

    @property
    def selection_overlap(self) -> float:
        """The share of the reference's selected keys the engine selected too (1.0 when none
        was compared)."""
        return 1.0 if not self.selection_keys else self.selection_keys_shared / self.selection_keys

    @property
    def selection_max_violation(self) -> float:
        """The largest violation of a row's selection (0 when every row selected as the
        reference did)."""
        return max(self.selection_violations, default=0.0)

    def selection_mismatches(self, limit: float) -> int:
        """Rows whose selection's violation is beyond ``limit`` (``selection_limit``): a
        selection rounding does not explain."""
        return sum(v > limit for v in self.selection_violations)

    @property
    def prefill_relative_error(self) -> float:
        """Prefill rows' largest error over the reference's largest value."""
        return _relative(self.prefill_max_abs_error, self.ref_max_abs)

    @property
    def decode_relative_error(self) -> float:
        """Decode rows' largest error over the reference's largest value."""
        return _relative(self.decode_max_abs_error, self.ref_max_abs)

    @property
    def dtype_relative_error(self) -> float:
        """The dense model in the engine's dtype: its largest error on the rows compared over
        the reference's largest value."""
        return _relative(self.dtype_max_abs_error, self.ref_max_abs)


def _relative(error: float, scale: float) -> float:
    """``error / scale``; infinite when either is not finite (a NaN reference made NaN, which
    every comparison and ``max`` dropped: a NaN run passed) or when a zero reference meets a
    non-zero error."""
    if not (math.isfinite(error) and math.isfinite(scale)):
        return float("inf")
    if scale == 0:
        return 0.0 if error == 0 else float("inf")
    return error / scale


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not got.numel():
        return 0.0
    # A NaN or inf anywhere is an infinite error (max propagates NaN; a NaN would otherwise
    # compare as "within tolerance").
    error = float((got - want).abs().max())
    return error if math.isfinite(error) else float("inf")


def check_generation(reference: ReferenceModel, output: RequestOutput,
                     max_prefill_rows: int | None = 32, max_decode_rows: int | None = 32,
                     routing_tolerance: float | None = None,
                     dtype_reference: ReferenceModel | None = None, *,
                     selection_tolerance: float | None = None) -> GenerationCheck:
    """Check ``output`` (kept ``hidden`` and ``row_kinds`` required) on ``sample_rows`` (the
    tokens chosen by the decode rows and the last prefill row checked). Rows with a routing
    margin within ``routing_tolerance`` (default: ``ROUTING_TOLERANCES`` of the output's
    dtype) are counted apart and not compared, and so are a sparse model's rows with a
    selection margin within ``selection_tolerance`` (default: ``SELECTION_TOLERANCES`` of the
    dtype). ``dtype_reference`` (the same weights' ``ReferenceModel`` in the engine's dtype)
    measures ``dtype_max_abs_error`` on the rows compared."""
    return check_generations(reference, [output], max_prefill_rows, max_decode_rows,
                             routing_tolerance, dtype_reference,
                             selection_tolerance=selection_tolerance)[0]


def check_generations(reference: ReferenceModel, outputs: Sequence[RequestOutput],
                      max_prefill_rows: int | None = 32, max_decode_rows: int | None = 32,
                      routing_tolerance: float | None = None,
                      dtype_reference: ReferenceModel | None = None, *,
                      selection_tolerance: float | None = None) -> list[GenerationCheck]:
    """``check_generation`` of every output, in order (sort them by their tokens so the
    reference reuses shared prefixes); the reference's last feed-forward runs once for all."""
    sampled = []
    for output in outputs:
        if output.hidden is None or output.row_kinds is None:
            raise ValueError(f"request {output.request_id!r} kept no outputs "
                             "(keep_outputs=False)")
        kinds = output.row_kinds.to("cpu")
        sampled.append((output, kinds, sample_rows(kinds, max_prefill_rows,
                                                   max_decode_rows=max_decode_rows)))
    todo = [(o.token_ids, rows) for o, _, rows in sampled if rows.numel()]
    given = [o.selections for o, _, rows in sampled if rows.numel()]
    chosen = given if any(g is not None for g in given) else None
    refs = iter(reference.outputs_many(todo, chosen))
    plain = iter(dtype_reference.outputs_many(todo, chosen) if dtype_reference is not None
                 else ())
    return [_evaluate(reference, output, kinds, rows, next(refs), routing_tolerance,
                      next(plain, None), selection_tolerance)
            if rows.numel() else
            GenerationCheck(output.request_id, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0)
            for output, kinds, rows in sampled]


def _evaluate(reference: ReferenceModel, output: RequestOutput, kinds: torch.Tensor,
              all_rows: torch.Tensor, ref: ReferenceRows, routing_tolerance: float | None,
              plain: ReferenceRows | None = None,
              selection_tolerance: float | None = None) -> GenerationCheck:
    """One output against its reference rows."""
    if output.hidden is None:  # pragma: no cover - checked by the caller
        raise ValueError("no outputs kept")
    tokens = output.token_ids
    tolerance = ROUTING_TOLERANCES.get(output.hidden.dtype, 0.0) if routing_tolerance is None \
        else routing_tolerance
    routing_clear = ref.margins > tolerance
    selection_clear = torch.ones_like(routing_clear)
    if ref.selection_margins is not None and ref.selection_compared is None:
        limit = SELECTION_TOLERANCES.get(output.hidden.dtype, 0.0) \
            if selection_tolerance is None else selection_tolerance
        selection_clear = ref.selection_margins > limit
    clear = routing_clear & selection_clear
    rows, want = all_rows[clear], ref.hidden[clear]
    got = output.hidden.index_select(0, rows.to(output.hidden.device)).to(
        device="cpu", dtype=torch.float64)
    is_decode = kinds.index_select(0, rows) == int(RowKind.DECODE)
    # Tokens: row p chose token p + 1 when p + 1 is a generated position.
    prompt_len = len(output.prompt_token_ids)
    chooser = (rows >= prompt_len - 1) & (rows < len(tokens) - 1)
    agree = ties = mismatches = 0
    if bool(chooser.any()):
        want_rows, got_rows = want[chooser], got[chooser]
        # The float64 argmax over the vocabulary (found in float32, then the two candidates'
        # logits recomputed in float64).
        best = reference.best_tokens(want_rows)
        chosen = torch.tensor(tokens, dtype=torch.int64)[rows[chooser] + 1]
        head_best, head_chosen = reference.lm_head_rows(best), reference.lm_head_rows(chosen)
        ref_best = (want_rows * head_best).sum(dim=1)
        ref_chosen = (want_rows * head_chosen).sum(dim=1)
        # How far the engine's own rows move those two logits: a flip within that is rounding.
        err = ((got_rows - want_rows) * head_best).sum(dim=1).abs() \
            + ((got_rows - want_rows) * head_chosen).sum(dim=1).abs()
        same = best == chosen
        tie = ~same & (ref_best - ref_chosen <= err + 1e-9 * ref_best.abs())
        agree, ties = int(same.sum()), int(tie.sum())
        mismatches = int((~same & ~tie).sum())
    plain_error, route_differences = _plain_error(plain, ref, clear)
    compared, keys, shared, violations = _selections(ref.selection_compared, routing_clear)
    return GenerationCheck(
        request_id=output.request_id,
        prefill_rows_checked=int((~is_decode).sum()),
        prefill_rows_computed=int((kinds == int(RowKind.PREFILL)).sum()),
        decode_rows_checked=int(is_decode.sum()),
        decode_rows_computed=int((kinds == int(RowKind.DECODE)).sum()),
        prefill_max_abs_error=_max_error(got[~is_decode], want[~is_decode]),
        decode_max_abs_error=_max_error(got[is_decode], want[is_decode]),
        ref_max_abs=_max_error(ref.hidden, torch.zeros_like(ref.hidden)),  # NaN: inf
        tokens_checked=agree + ties + mismatches, tokens_agreeing=agree, near_ties=ties,
        token_mismatches=mismatches, routing_near_ties=int((~routing_clear).sum()),
        selection_near_ties=int((~selection_clear).sum()),
        dtype_max_abs_error=plain_error, dtype_route_differences=route_differences,
        selection_rows_compared=compared, selection_keys=keys, selection_keys_shared=shared,
        selection_violations=violations)


def _plain_error(plain: ReferenceRows | None, ref: ReferenceRows, clear: torch.Tensor
                 ) -> tuple[float, int]:
    """``dtype_max_abs_error`` of the plain dense model ``plain`` on the ``clear`` rows it
    routed as float64 did, and how many it routed otherwise."""
    if plain is None:
        return 0.0, 0
    same = torch.ones_like(clear) if plain.routes is None or ref.routes is None \
        else plain.routes == ref.routes
    rows = clear & same
    return (_max_error(plain.hidden[rows].to(dtype=torch.float64), ref.hidden[rows]),
            int((clear & ~same).sum()))


def _selections(compared: torch.Tensor | None, routing_clear: torch.Tensor
                ) -> tuple[int, int, int, tuple[float, ...]]:
    """The ``GenerationCheck`` fields of the selection comparison (``compared``:
    ``ReferenceRows.selection_compared``) on the rows without a routing near-tie (their
    inputs may legitimately differ): rows compared, keys, keys shared, violations."""
    if compared is None:
        return 0, 0, 0, ()
    rows = compared[routing_clear & (compared[:, 1] > 0)]
    other = rows[(rows[:, 0] < rows[:, 1]) | (rows[:, 2] > 0)]
    return (int(rows.shape[0]), int(rows[:, 1].sum()), int(rows[:, 0].sum()),
            tuple(sorted(other[:, 2].tolist(), reverse=True)))

# -- the whole check of one engine run (``python -m app run``) ----------------------------

#: The check runs in this many groups of requests, so that progress can be shown after each
#: (each group runs the last layer's feed-forward once over its rows).
CHECK_GROUPS = 8


def _groups(items: list[Any], count: int) -> list[list[Any]]:
    """``items`` in at most ``count`` consecutive groups of near-equal size."""
    size = max(1, math.ceil(len(items) / count))
    return [items[i:i + size] for i in range(0, len(items), size)]


def check_engine_outputs(engine: Any, outputs: Sequence[RequestOutput], prefill_rows: int,
                         decode_rows: int, dtype: torch.dtype,
                         progress: Callable[[int], object] | None = None) -> dict[str, Any]:
    """``run``'s float64 check of an engine's finished requests, as one JSON-ready summary:
    every request teacher-forced through the dense float64 model (``prefill_rows`` /
    ``decode_rows`` sampled per request; -1: every row), the tolerance derived from the same
    model computed in ``dtype``, the tokens and, for a sparse model, the selections compared.
    ``progress(n)`` is told how many requests are checked after each group of them."""
    start = time.perf_counter()
    reference = ReferenceModel(engine.weights)
    cache_dtype = engine.config.cache.kv_cache_dtype
    # what the dtype (and an FP8 cache) alone cost
    plain = ReferenceModel(engine.weights, dtype=dtype, kv_cache_dtype=cache_dtype)
    keys = ("prefill_rows_checked", "prefill_rows_computed", "decode_rows_checked",
            "decode_rows_computed", "tokens_checked", "tokens_agreeing", "near_ties",
            "token_mismatches", "routing_near_ties", "selection_near_ties",
            "selection_rows_compared", "selection_keys", "selection_keys_shared",
            "dtype_route_differences")
    totals = dict.fromkeys(keys, 0)
    prefill_err = decode_err = prefill_abs = decode_abs = scale = dtype_err = 0.0
    # Sorted by tokens: requests sharing a prompt prefix are adjacent, and the reference
    # reuses the keys and values of the common prefix (across groups too: it keeps them).
    ordered = sorted(outputs, key=lambda o: o.token_ids)
    results: list[Any] = []
    for group in _groups(ordered, CHECK_GROUPS):
        results.extend(check_generations(reference, group,
                                         None if prefill_rows < 0 else prefill_rows,
                                         None if decode_rows < 0 else decode_rows,
                                         routing_tolerance=routing_tolerance(dtype, cache_dtype),
                                         dtype_reference=plain))
        if progress is not None:
            progress(len(results))
    for result in results:
        for key in keys:
            totals[key] += getattr(result, key)
        prefill_err = max(prefill_err, result.prefill_relative_error)
        decode_err = max(decode_err, result.decode_relative_error)
        prefill_abs = max(prefill_abs, result.prefill_max_abs_error)
        decode_abs = max(decode_abs, result.decode_max_abs_error)
        scale = max(scale, result.ref_max_abs)
        dtype_err = max(dtype_err, result.dtype_relative_error)
    tolerance = derived_tolerance(dtype, dtype_err)
    limit = selection_limit(dtype, tolerance)
    violations = [v for result in results for v in result.selection_violations]
    totals["selection_differences"] = len(violations)
    totals["selection_mismatches"] = sum(result.selection_mismatches(limit)
                                         for result in results)
    passed = prefill_err <= tolerance and decode_err <= tolerance \
        and totals["token_mismatches"] == 0 and totals["selection_mismatches"] == 0
    prefill_text = "every prefill row" if prefill_rows < 0 else (
        f"at most {prefill_rows} prefill rows (the last 16, the others at a stride)")
    decode_text = "every decode row" if decode_rows < 0 else (
        f"at most {decode_rows} decode rows (the first 8 and the last 8, the others at a "
        f"stride)")
    sample = (f"per request: {prefill_text}, {decode_text}; the tokens those rows chose")
    return {"enabled": True, "reference": "the dense float64 model, teacher-forced on each "
            "final sequence (prompt + generated)", "sample": sample, **totals,
            "prefill_max_relative_error": prefill_err, "decode_max_relative_error": decode_err,
            "prefill_max_abs_error": prefill_abs, "decode_max_abs_error": decode_abs,
            "ref_max_abs": scale, "max_relative_error": max(prefill_err, decode_err),
            "dtype_max_relative_error": dtype_err, "tolerance": tolerance,
            "tolerance_floor": reference_tolerance(dtype),
            "tolerance_rule": tolerance_rule(dtype, cache_dtype),
            "routing_tolerance": routing_tolerance(dtype, cache_dtype),
            "selection_limit": limit, "selection_max_violation": max(violations, default=0.0),
            "passed": passed,
            "reference_tokens_reused": reference.reused_tokens,
            "reference_tokens_computed": reference.computed_tokens,
            "seconds": round(time.perf_counter() - start, 3)}
