"""The layer, its float64 reference and the paged latent cache."""

from __future__ import annotations

import pytest
import torch

from app.config import ModelConfig
from app.mla.cache import PagedLatentCache, slot_indices
from app.mla.layer import MLALayer, MLALayerWeights, TokenEmbedding, default_compute_dtype
from app.mla.reference import check_against_reference, reference_forward, reference_tolerance
from tests.mla.conftest import TINY, VOCAB


def test_weights_are_deterministic_and_exact_in_the_model_dtype() -> None:
    model = ModelConfig(dtype="bfloat16", **TINY)
    a, b = MLALayerWeights.generate(model, 3), MLALayerWeights.generate(model, 3)
    c = MLALayerWeights.generate(model, 4)
    assert torch.equal(a.w_q, b.w_q) and not torch.equal(a.w_q, c.w_q)
    assert a.w_q.dtype == torch.float64
    assert torch.equal(a.w_kv_b.to(torch.bfloat16).double(), a.w_kv_b)
    assert a.w_q.shape == (2 * (16 + 8), 64) and a.w_kv_a.shape == (32 + 8, 64)
    assert a.w_kv_b.shape == (2 * (16 + 16), 32) and a.w_o.shape == (64, 2 * 16)


def test_odd_rope_dim_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        MLALayerWeights.generate(ModelConfig(**{**TINY, "qk_rope_head_dim": 7}))


def test_reference_rows_are_causal_and_sliceable() -> None:
    model = ModelConfig(dtype="float32", **TINY)
    weights = MLALayerWeights.generate(model, 0)
    emb = TokenEmbedding.generate(VOCAB, 64, torch.float32, 0)
    tokens = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(0))
    full = reference_forward(weights, emb.lookup(tokens))
    assert full.shape == (150, 64) and full.dtype == torch.float64
    torch.testing.assert_close(reference_forward(weights, emb.lookup(tokens), 70), full[70:])
    torch.testing.assert_close(reference_forward(weights, emb.lookup(tokens), 10, 90),
                               full[10:90])
    # Causal: changing later tokens leaves earlier rows alone.
    changed = tokens.clone()
    changed[100:] = (changed[100:] + 1) % VOCAB
    other = reference_forward(weights, emb.lookup(changed))
    torch.testing.assert_close(other[:100], full[:100])
    assert not torch.allclose(other[100:], full[100:])
    with pytest.raises(ValueError, match="start <= end"):
        reference_forward(weights, emb.lookup(tokens), 10, 5)


def test_layer_matches_the_reference_on_a_single_token() -> None:
    """Row 0 attends only to itself: out = W_o v(x0), whatever q is."""
    model = ModelConfig(dtype="float32", **TINY)
    weights = MLALayerWeights.generate(model, 1)
    layer = MLALayer(weights)
    x = TokenEmbedding.generate(VOCAB, 64, torch.float32, 1).lookup(torch.tensor([5]))
    _, latent = layer.project(x.float(), torch.tensor([0]), 0)
    _, v = layer.up_project(latent)
    got = layer.output(v)
    torch.testing.assert_close(got.double(), reference_forward(weights, x), rtol=1e-5,
                               atol=1e-5)


def test_compute_dtype() -> None:
    assert default_compute_dtype(torch.float32, "cpu") == torch.float32
    assert default_compute_dtype(torch.bfloat16, "cpu", fast_low_precision=False) == \
        torch.float32
    assert default_compute_dtype(torch.bfloat16, "cpu", fast_low_precision=True) == \
        torch.bfloat16


def test_cache_write_and_gather_by_block_table() -> None:
    cache = PagedLatentCache(num_blocks=8, block_size=4, latent_dim=3, dtype=torch.float32)
    table = torch.tensor([5, 2, 7])
    slots = slot_indices(table, 0, 10, 4)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    values = torch.arange(30, dtype=torch.float32).view(10, 3)
    cache.write(slots, values)
    torch.testing.assert_close(cache.read_tokens([5, 2, 7], 3, 9), values[3:9])
    assert cache.data[2, 1].tolist() == values[5].tolist()
    out = torch.full((12, 3), -1.0)
    got = cache.gather(slot_indices(table, 4, 6, 4), out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, values[4:6])
    with pytest.raises(ValueError, match="blocks"):
        slot_indices(table, 0, 13, 4)
    with pytest.raises(ValueError, match="slots must be in"):
        cache.write(torch.tensor([32]), values[:1])
    with pytest.raises(ValueError, match="latent"):
        cache.write(slots, values[:, :2])
    with pytest.raises(ValueError, match="int64"):
        cache.gather(slots.int())


def test_check_against_reference_flags_nan_and_counts_rows() -> None:
    model = ModelConfig(dtype="float32", **TINY)
    weights = MLALayerWeights.generate(model, 0)
    emb = TokenEmbedding.generate(VOCAB, 64, torch.float32, 0)
    tokens = list(range(20))
    ref = reference_forward(weights, emb.lookup(torch.tensor(tokens))).float()
    rows = torch.zeros(20, dtype=torch.bool)
    rows[8:] = True
    good = check_against_reference(weights, emb, "r", tokens, ref, rows)
    assert good.rows_checked == 12 and good.relative_error < 1e-6
    bad = ref.clone()
    bad[15, 3] = float("nan")
    assert check_against_reference(weights, emb, "r", tokens, bad, rows).max_abs_error == \
        float("inf")
    # Rows outside the computed mask are not compared.
    assert check_against_reference(weights, emb, "r", tokens, ref.masked_fill(
        ~rows.unsqueeze(1), 123.0), rows).relative_error < 1e-6
    assert reference_tolerance(torch.bfloat16) > reference_tolerance(torch.float32)
    with pytest.raises(ValueError, match="tolerance"):
        reference_tolerance(torch.float64)
