"""``app.model.sparse.selections``: an engine's selections kept as bitmasks.

Each row's selected positions become ``ceil(keys / 8)`` bytes, whatever ``index_topk`` is, and
come back as the same increasing positions with ``-1`` padding (a row of ``-1`` where none was
kept); a selection that is not a uint8 ``[indexer layers, S, ceil(S / 8)]`` is refused.
"""

from __future__ import annotations

import pytest
import torch

from app.model.sparse.selections import (
    check_keep_selections,
    checked_selections,
    pack_positions,
    selection_bytes,
    unpack_positions,
)


def test_positions_round_trip_through_their_bitmask() -> None:
    gen = torch.Generator().manual_seed(0)
    keys = 37
    rows = []
    for row in range(12):
        seen = min(row + 1, keys)
        picked = torch.randperm(seen, generator=gen)[:min(5, seen)].sort().values
        rows.append(torch.cat([picked, torch.full((5 - picked.numel(),), -1)]))
    positions = torch.stack(rows).to(torch.int32)
    bits = pack_positions(positions, keys)
    assert bits.dtype == torch.uint8 and bits.shape == (12, selection_bytes(keys)) == (12, 5)
    assert unpack_positions(bits).tolist() == positions.tolist()


def test_a_row_without_a_selection_is_all_zero_and_reads_as_minus_one() -> None:
    bits = pack_positions(torch.tensor([[[-1, -1], [0, 9]]]), 10)
    assert bits.shape == (1, 2, 2) and bits[0, 0].tolist() == [0, 0]
    assert bits[0, 1].tolist() == [1, 2]                  # position 0; position 9: byte 1 bit 1
    assert unpack_positions(bits[0]).tolist() == [[-1, -1], [0, 9]]
    assert unpack_positions(bits[0, :1]).shape == (1, 0)  # nothing kept: no column


def test_the_bitmask_does_not_grow_with_index_topk() -> None:
    # a row of 100 visible keys all selected (index_topk >= 100) and 8 of them: 13 bytes each
    every = pack_positions(torch.arange(100).view(1, -1), 100)
    some = pack_positions(torch.arange(0, 100, 13).view(1, -1), 100)
    assert every.numel() == some.numel() == 13
    assert unpack_positions(every).tolist() == [list(range(100))]


def test_selections_of_the_wrong_shape_or_dtype_are_refused() -> None:
    good = torch.zeros(2, 9, 2, dtype=torch.uint8)
    (checked,) = checked_selections([9], [good], 2)
    assert checked is not None and checked.shape == (2, 9, 2)
    assert checked_selections([9], [None], 2) == [None]
    for bad, layers in ((good.to(torch.int32), 2), (good[:, :8], 2), (good[..., :1], 2),
                        (good, 1), (good, None), (good.tolist(), 2)):
        with pytest.raises(ValueError, match="uint8 bitmask"):
            checked_selections([9], [bad], layers)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 selections for 2 sequences"):
        checked_selections([9, 9], [good], 2)


def test_keep_selections_is_a_bool_for_a_sparse_model_that_keeps_outputs() -> None:
    check_keep_selections(False, False, False)
    check_keep_selections(True, True, True)
    with pytest.raises(TypeError, match="keep_selections must be a bool"):
        check_keep_selections(1, True, True)
    with pytest.raises(ValueError, match="keep_outputs"):
        check_keep_selections(True, False, True)
    with pytest.raises(ValueError, match="sparse model"):
        check_keep_selections(True, True, False)
