"""The teacher-forced float64 check catches wrong rows and wrong tokens, samples as stated and
reuses the reference's keys along a common prefix."""

from __future__ import annotations

import attrs
import torch

from app.mla.checks import (
    DTYPE_ERROR_FACTOR,
    check_generation,
    derived_tolerance,
    sample_rows,
    tolerance_rule,
)
from app.mla.engine import MLAEngine
from app.mla.requests import Request, RequestOutput, RowKind
from app.model import ReferenceModel
from tests.mla.conftest import VOCAB, tiny_engine


def _run() -> tuple[MLAEngine, list[RequestOutput]]:
    engine = tiny_engine(step_tokens=32)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    outputs = engine.run([Request("a", prompt, max_new_tokens=8),
                          Request("b", [*prompt[:24], 1, 2, 3], max_new_tokens=8)])
    return engine, sorted(outputs, key=lambda o: o.request_id)


def test_sample_rows_keeps_the_edges_and_strides_the_rest() -> None:
    kinds = torch.tensor([0] * 8 + [1] * 100 + [2] * 60 + [0], dtype=torch.int8)
    rows = sample_rows(kinds, max_prefill_rows=14, tail_rows=4, max_decode_rows=20,
                       edge_rows=5).tolist()
    assert rows == sorted(rows)
    prefill = [r for r in rows if r < 108]
    decode = [r for r in rows if r >= 108]
    assert len(prefill) == 14 and set(range(104, 108)) <= set(prefill) and min(rows) == 8
    assert len(decode) == 20
    assert set(range(108, 113)) <= set(decode)          # the first decode rows
    assert set(range(163, 168)) <= set(decode)          # the request's last rows
    assert sample_rows(kinds, None, max_decode_rows=None).tolist() == list(range(8, 168))
    assert sample_rows(kinds, 200, max_decode_rows=100).tolist() == list(range(8, 168))


def test_the_check_catches_a_wrong_row_and_a_wrong_token() -> None:
    engine, (a, b) = _run()
    reference = ReferenceModel(engine.weights)
    good = check_generation(reference, a, max_prefill_rows=None)
    assert good.decode_relative_error < 1e-5 and good.token_mismatches == 0
    assert good.tokens_checked == 8 and good.decode_rows_checked == 7
    assert good.prefill_rows_checked == 40
    # a decode row off by a little more than float32 rounding
    assert a.hidden is not None and a.row_kinds is not None
    hidden = a.hidden.clone()
    hidden[42] += 1e-3
    bad_row = check_generation(reference, attrs.evolve(a, hidden=hidden), None)
    assert bad_row.decode_relative_error > 1e-4 and bad_row.prefill_relative_error < 1e-5
    # the least likely token instead of the greedy one
    # hidden lives on the engine's device, the weights given to it on the host (issue 35: on a
    # GPU this line mixed cuda:0 and cpu; the check itself moves what it reads to the host)
    row = a.hidden[44].cpu().double() @ engine.weights.lm_head.double().t()
    tokens = list(a.output_token_ids)
    tokens[5] = int(row.argmin())
    wrong = check_generation(reference, attrs.evolve(a, output_token_ids=tuple(tokens)), None)
    assert wrong.token_mismatches == 1
    # b shares 24 prompt tokens with a: the reference reuses their keys
    reused = reference.reused_tokens
    check_generation(reference, b)
    assert reference.reused_tokens - reused == 24
    assert int((b.row_kinds == int(RowKind.NOT_COMPUTED)).sum()) >= 16   # b's prefix hit


def test_a_nan_or_a_zero_reference_never_passes() -> None:
    # issue 21: with softmax_scale = 1e308 the engine and the reference were both NaN; NaN
    # relative errors were dropped by max() and the run passed with "max error 0".
    from app.mla.checks import GenerationCheck

    def check(error: float, scale: float) -> GenerationCheck:
        return GenerationCheck("r", 1, 1, 1, 1, error, error, scale, 0, 0, 0, 0)

    nan, inf = float("nan"), float("inf")
    for error, scale in ((inf, nan), (1.0, nan), (nan, 1.0), (1e-3, 0.0), (inf, 2.0)):
        assert check(error, scale).prefill_relative_error == inf
        assert check(error, scale).decode_relative_error == inf
    assert check(0.0, 0.0).decode_relative_error == 0.0
    assert check(1e-3, 2.0).decode_relative_error == 5e-4
    engine, (a, _) = _run()
    reference = ReferenceModel(engine.weights)
    assert a.hidden is not None
    hidden = a.hidden.clone()
    hidden[42] = float("nan")
    poisoned = check_generation(reference, attrs.evolve(a, hidden=hidden), None)
    assert poisoned.decode_relative_error == inf


def test_the_tolerance_is_derived_from_the_dtypes_own_error() -> None:
    engine = tiny_engine(step_tokens=32, dtype="bfloat16")
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    out = engine.run([Request("a", prompt, max_new_tokens=6)])[0]
    plain = ReferenceModel(engine.weights, dtype=torch.bfloat16)
    result = check_generation(ReferenceModel(engine.weights), out, None, None,
                              dtype_reference=plain)
    # The plain bf16 model is off float64 by bf16's rounding, as the engine is.
    assert 1e-4 < result.dtype_relative_error < 3e-2
    assert result.decode_relative_error < DTYPE_ERROR_FACTOR * max(result.dtype_relative_error,
                                                                   1.5e-2)
    unmeasured = check_generation(ReferenceModel(engine.weights), out, None, None)
    assert unmeasured.dtype_max_abs_error == 0.0
    # The rule: the floor, or twice the measurement; a NaN measurement never widens it.
    assert derived_tolerance(torch.bfloat16, 1e-3) == 3e-2
    assert derived_tolerance(torch.bfloat16, 0.25) == 0.5
    assert derived_tolerance(torch.bfloat16, float("nan")) == 3e-2
    assert derived_tolerance(torch.float32, float("inf")) == 1e-4
    assert tolerance_rule(torch.float32).startswith("max(1e-04, 2 x the relative error of the "
                                                    "same dense model computed in float32")
