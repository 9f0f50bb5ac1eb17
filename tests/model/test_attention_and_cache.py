"""The MLA layer, rope, the float64 references and the paged latent cache."""

from __future__ import annotations

import math

import pytest
import torch

from app.model import (
    PagedLatentCache,
    RopeConfig,
    RotaryEmbedding,
    apply_rope,
    default_compute_dtype,
    random_weights,
    reference_attention,
    reference_tolerance,
    rope_inv_freq,
    slot_indices,
)
from tests.model.conftest import VOCAB, Harness, tiny_arch, tiny_model


def test_random_weights_are_deterministic_and_shaped_as_the_checkpoints() -> None:
    arch = tiny_arch(torch.bfloat16, layers=2)
    a, b = random_weights(arch, torch.bfloat16, 3), random_weights(arch, torch.bfloat16, 3)
    c = random_weights(arch, torch.bfloat16, 4)
    assert torch.equal(a.embed_tokens, b.embed_tokens)
    assert not torch.equal(a.embed_tokens, c.embed_tokens)
    attn = a.layers[0].attention
    assert attn.q_proj is None and attn.q_a_proj is not None and attn.q_b_proj is not None
    assert attn.q_b_proj.shape == (2 * (16 + 8), arch.q_lora_rank)
    assert attn.kv_a_proj.shape == (32 + 8, 64) and attn.kv_b_proj.shape == (2 * (16 + 16), 32)
    assert attn.o_proj.shape == (64, 2 * 16) and attn.kv_b_proj.dtype == torch.bfloat16
    moe = a.layers[1].mlp
    assert arch.is_moe_layer(1) and not arch.is_moe_layer(0)
    assert moe.gate.dtype == torch.float32  # type: ignore[union-attr]
    assert a.lm_head is not a.embed_tokens and a.lm_head.shape == (VOCAB, 64)


def test_odd_rope_dim_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        tiny_arch().__class__(**{**{f: getattr(tiny_arch(), f) for f in (
            "architecture", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim")}, "qk_rope_head_dim": 7})


def test_interleaved_rope_rotates_adjacent_pairs_and_rotate_half_rotates_halves() -> None:
    x = torch.arange(1.0, 9.0).view(1, 8)
    angle = torch.tensor([[0.3, 0.7, 1.1, 1.9]])
    cos, sin = angle.cos(), angle.sin()
    inter = apply_rope(x, cos, sin, interleaved=True)
    half = apply_rope(x, cos, sin, interleaved=False)
    for i in range(4):  # pair (2i, 2i+1) by angle i
        a, b = x[0, 2 * i], x[0, 2 * i + 1]
        c, s = cos[0, i], sin[0, i]
        torch.testing.assert_close(inter[0, 2 * i:2 * i + 2], torch.stack((a * c - b * s,
                                                                           b * c + a * s)))
        a, b = x[0, i], x[0, i + 4]
        torch.testing.assert_close(half[0, [i, i + 4]], torch.stack((a * c - b * s,
                                                                    b * c + a * s)))
    # a rotation keeps norms, and a query rotated like its key keeps q.k relative
    assert math.isclose(float(inter.norm()), float(x.norm()), rel_tol=1e-6)


def test_yarn_frequencies_ramp_between_interpolation_and_extrapolation() -> None:
    plain = RopeConfig(theta=10000.0)
    yarn = RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0,
                      original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    base, scaled = rope_inv_freq(plain, 64), rope_inv_freq(yarn, 64)
    torch.testing.assert_close(scaled[:8], base[:8])            # fast dims: extrapolated
    torch.testing.assert_close(scaled[-4:], base[-4:] / 40.0)   # slow dims: interpolated
    assert bool(((scaled <= base * (1 + 1e-12)) & (scaled >= base / 40.0 * (1 - 1e-12))).all())
    assert yarn.cos_sin_scale == 1.0                            # mscale == mscale_all_dim
    assert math.isclose(yarn.softmax_scale_multiplier, (0.1 * math.log(40) + 1) ** 2)
    v2 = RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0,
                    original_max_position_embeddings=4096)
    assert math.isclose(v2.cos_sin_scale, 0.1 * math.log(40) + 1)  # no mscale: get_mscale
    assert v2.softmax_scale_multiplier == 1.0
    emb = RotaryEmbedding(yarn, 64, torch.float64, torch.device("cpu"), initial_positions=4)
    cos, _ = emb.cos_sin(torch.tensor([0, 9]), 9)               # grows past the table
    assert cos.shape == (2, 32) and float(cos[0, 0]) == 1.0


def test_reference_attention_rows_are_causal_and_sliceable() -> None:
    h = Harness()
    tokens = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(0))
    full = h.reference(tokens.tolist(), 0)
    assert full.shape == (150, 64) and full.dtype == torch.float64
    torch.testing.assert_close(h.reference(tokens.tolist(), 70), full[70:])
    changed = tokens.clone()
    changed[100:] = (changed[100:] + 1) % VOCAB
    other = h.reference(changed.tolist(), 0)
    torch.testing.assert_close(other[:100], full[:100])         # causal
    assert not torch.allclose(other[100:], full[100:])
    with pytest.raises(ValueError, match="start <= end"):
        reference_attention(h.arch, h.weights.layers[0].attention, h.lookup(tokens.tolist()),
                            10, 5)


def test_layer_matches_the_reference_on_a_single_token() -> None:
    """Row 0 attends only to itself: out = o_proj v(x0), whatever q is."""
    h = Harness()
    x = h.lookup([5])
    _, latent = h.layer.project(x, torch.tensor([0]), 0)
    _, v = h.layer.up_project(latent)
    torch.testing.assert_close(h.layer.output(v).double(), h.reference([5], 0), rtol=1e-5,
                               atol=1e-5)


def test_absorbed_form_equals_the_up_projected_form() -> None:
    """q_nope . k_nope == (q_nope W_UK) . kv_c, and W_UV over the latent output == v."""
    h = Harness()
    x = h.lookup(h.tokens(6))
    q, latent = h.layer.project(x, torch.arange(6), 5)
    k, v = h.layer.up_project(latent)
    q_abs = h.layer.absorb_query(q)
    lr, p = h.layer.kv_lora_rank, h.layer.qk_nope_head_dim
    direct = torch.einsum("thd,shd->hts", q[..., :p].double(), k[..., :p].double())
    absorbed = torch.einsum("thl,sl->hts", q_abs[..., :lr].double(), latent[:, :lr].double())
    torch.testing.assert_close(absorbed, direct, rtol=1e-4, atol=1e-4)
    probs = torch.softmax(torch.randn(6, 2, 6, dtype=torch.float64), dim=-1)
    latent_out = torch.einsum("ths,sl->thl", probs, latent[:, :lr].double()).float()
    torch.testing.assert_close(h.layer.unabsorb_output(latent_out).double(),
                               torch.einsum("ths,shv->thv", probs, v.double()),
                               rtol=1e-4, atol=1e-4)


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


def test_reference_tolerances() -> None:
    assert reference_tolerance(torch.bfloat16) > reference_tolerance(torch.float32)
    with pytest.raises(ValueError, match="tolerance"):
        reference_tolerance(torch.float64)
    arch, _ = tiny_model()
    assert arch.model_config().scale == arch.softmax_scale


def test_a_write_with_host_bounds_reads_nothing_back_and_still_refuses() -> None:
    """Issue 35: a decode plan knows its slots' bounds on the host; the cache checks those
    instead of reading the slots back from the device, and refuses them the same way."""
    from app.model.cache import PagedLatentCache

    cache = PagedLatentCache(4, 2, 3, torch.float32)
    slots = torch.tensor([1, 6])
    latent = torch.ones(2, 3)
    cache.write(slots, latent, bounds=(1, 6))
    assert cache.data.view(8, 3)[6].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"slots must be in \[0, 8\), got \[1, 8\]"):
        cache.write(slots, latent, bounds=(1, 8))
