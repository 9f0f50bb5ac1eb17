"""``app.model.linear``: weights reordered once for oneDNN give ``F.linear``'s results, only
where the probe says so, and the model's numbers do not depend on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.model import MLAAttention, RotaryEmbedding
from app.model.linear import PACKED_LINEAR_ENV, Linear, packed_linear_available
from tests.model.conftest import tiny_model

needs_packing = pytest.mark.skipif(not packed_linear_available(torch.bfloat16),
                                   reason="no oneDNN bf16 linear on this CPU / torch build")


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
def test_a_reordered_weight_gives_f_linears_result(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=gen) / 9).to(torch.bfloat16)
    linear = Linear(weight)
    assert linear.packed and linear.nbytes == weight.numel() * 2
    assert (linear.out_features, linear.in_features) == (96, 80)
    wide = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)
    for x in (wide[:, :80].contiguous(), wide[:, 20:], wide[:, 20:].reshape(-1, 1, 80)):
        got = linear(x)
        want = F.linear(x, weight)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_float32_other_devices_and_the_switch_keep_the_plain_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(8, 4)
    linear = Linear(weight)
    assert not linear.packed and linear.nbytes == 0
    x = torch.randn(3, 4)
    assert torch.equal(linear(x), F.linear(x, weight))     # float32: exactly F.linear
    assert not packed_linear_available(torch.float32)
    assert not packed_linear_available(torch.bfloat16, "cuda")
    assert not Linear(weight.to(torch.bfloat16), pack=False).packed
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    assert not packed_linear_available(torch.bfloat16)
    assert not Linear(weight.to(torch.bfloat16)).packed


def test_a_weight_must_be_a_matrix() -> None:
    with pytest.raises(ValueError, match=r"2-D \[out, in\], got \[2, 3, 4\]"):
        Linear(torch.zeros(2, 3, 4))


@needs_packing
def test_the_layers_projections_do_not_depend_on_the_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    arch, weights = tiny_model(torch.bfloat16)
    rope = RotaryEmbedding(arch.rope, arch.qk_rope_head_dim, torch.bfloat16,
                           torch.device("cpu"), interleaved=arch.rope_interleave)

    def layer() -> MLAAttention:
        return MLAAttention(arch, weights.layers[0].attention, dtype=torch.bfloat16,
                            compute_dtype=torch.bfloat16, device=torch.device("cpu"),
                            rope=rope)

    packed = layer()
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    plain = layer()
    assert packed._x_proj is not None and plain._x_proj is None
    x = torch.randn(7, arch.hidden_size).to(torch.bfloat16)
    positions = torch.arange(3, 10)
    for got, want in zip(packed.project(x, positions, 9), plain.project(x, positions, 9),
                         strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    latent = torch.randn(5, packed.latent_dim).to(torch.bfloat16)
    for got, want in zip(packed.up_project(latent), plain.up_project(latent), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    attn = torch.randn(4, arch.num_attention_heads, arch.v_head_dim).to(torch.bfloat16)
    torch.testing.assert_close(packed.output(attn).float(), plain.output(attn).float(),
                               rtol=2e-2, atol=2e-2)
