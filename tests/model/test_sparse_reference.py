"""``app.model.sparse.reference``: an engine's selection against the float64 scores.

``compare_selection`` reports, per row, the keys both selected, the keys the reference selected
and the *violation* of the engine's selection (the best score it left out minus the worst it
kept, over the row's largest score): 0 for the reference's own top-k or an equal tie, the
score margin for a near-tie swap, inf for a key that is not visible or a key too few.
"""

from __future__ import annotations

import math

import pytest
import torch

from app.backends.sparse.indexer import topk_positions
from app.model.sparse.reference import accumulate_comparisons, compare_selection

INF = float("inf")
#: One row of scores over 6 positions (the last not visible), top-3: 0, 2, 3 (10, 9, 8.5);
#: 8.4 at position 1 is a near-tie with 8.5.
SCORES = torch.tensor([[10.0, 8.4, 9.0, 8.5, 1.0, -INF]], dtype=torch.float64)


def _compare(chosen: list[int]) -> tuple[float, float, float]:
    own = topk_positions(SCORES, 3).to(torch.int64)
    shared, keys, violation = compare_selection(SCORES, torch.tensor([chosen]), own)[0].tolist()
    return shared, keys, violation


def test_the_reference_top_k_has_no_violation() -> None:
    assert _compare([0, 2, 3]) == (3.0, 3.0, 0.0)


def test_a_near_tie_swap_is_its_score_margin() -> None:
    shared, keys, violation = _compare([0, 1, 2])
    assert (shared, keys) == (2.0, 3.0)
    assert violation == pytest.approx((8.5 - 8.4) / 10.0)


def test_a_far_swap_is_a_large_violation() -> None:
    _, _, violation = _compare([0, 2, 4])
    assert violation == pytest.approx((8.5 - 1.0) / 10.0)


@pytest.mark.parametrize("chosen", [[0, 2, 5], [0, 2, 9], [0, 2, -1]])
def test_an_invisible_or_missing_key_is_an_infinite_violation(chosen: list[int]) -> None:
    assert math.isinf(_compare(chosen)[2])


def test_comparisons_accumulate_over_layers() -> None:
    a = torch.tensor([[2.0, 3.0, 0.1]], dtype=torch.float64)
    b = torch.tensor([[3.0, 3.0, 0.0]], dtype=torch.float64)
    assert accumulate_comparisons(a, b).tolist() == [[5.0, 6.0, 0.1]]
