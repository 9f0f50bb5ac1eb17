"""The float64 reference: its first layer's per-token table gives what computing every
position does."""

from __future__ import annotations

import pytest
import torch

import app.model.reference as reference_module
from app.model import ReferenceModel
from tests.model.conftest import VOCAB, tiny_model


@pytest.mark.parametrize("layers", [1, 2])
def test_the_first_layer_table_equals_computing_every_position(
        layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _, weights = tiny_model(layers=layers)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    # Sorted by tokens as the check sorts them: the second reuses a prefix of the first, the
    # third none; token ids repeat within and across sequences.
    sequences = sorted([[*shared, *shared[:7]], [*shared[:12], 3, 3, 3, 5],
                        torch.randint(0, VOCAB, (25,), generator=gen).tolist()])
    items = [(s, torch.arange(len(s) - 6, len(s))) for s in sequences]
    with_table = ReferenceModel(weights)
    got = with_table.outputs_many(items)
    assert with_table._memo_known is not None and with_table._memo_known.any()
    monkeypatch.setattr(reference_module, "TOKEN_MEMO_BYTES", 0)
    without = ReferenceModel(weights)
    want = without.outputs_many(items)
    assert without._memo is None
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.hidden, w.hidden, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g.margins, w.margins, rtol=1e-12, atol=1e-12)
    assert with_table.reused_tokens == without.reused_tokens > 0


def test_the_reference_in_a_16_bit_dtype_is_refused_for_other_dtypes() -> None:
    _, weights = tiny_model(torch.bfloat16)
    assert ReferenceModel(weights, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be float64, float32, bfloat16 or float16"):
        ReferenceModel(weights, dtype=torch.int32)
