"""merge_attn_states: natural-log LSE merge, -inf safe, never NaN, alias-safe ``out``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.backends.merge import merge_attn_states
from app.testing import reference_attention

H, D = 3, 16


def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t, n = q.shape[0], k.shape[0]
    out, lse = reference_attention(q, k, v, [0, t], [0, n], False, 1 / math.sqrt(q.shape[-1]))
    return out.float(), lse.float()


def test_merge_equals_attention_over_the_union() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, H, 8, generator=gen)
    k = torch.randn(11, H, 8, generator=gen)
    v = torch.randn(11, H, D, generator=gen)
    a_out, a_lse = _attn(q, k[:4], v[:4])
    b_out, b_lse = _attn(q, k[4:], v[4:])
    ref_out, ref_lse = _attn(q, k, v)
    out, lse = merge_attn_states(a_out, a_lse, b_out, b_lse)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (H, 5)


def test_minus_inf_on_either_side_and_both() -> None:
    out_a = torch.randn(4, H, D)
    out_b = torch.randn(4, H, D)
    lse_a = torch.randn(H, 4)
    lse_b = torch.randn(H, 4)
    lse_a[:, 0] = -math.inf            # row 0: only b
    lse_b[:, 1] = -math.inf            # row 1: only a
    lse_a[:, 2] = lse_b[:, 2] = -math.inf
    out_a[:, :][2] = 0.0
    out_b[:, :][2] = 0.0               # row 2: neither (outputs are 0 there by contract)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0], out_b[0])
    torch.testing.assert_close(lse[:, 0], lse_b[:, 0])
    torch.testing.assert_close(out[1], out_a[1])
    torch.testing.assert_close(lse[:, 1], lse_a[:, 1])
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[:, 2]).all())


@pytest.mark.parametrize("alias", ["prefix", "suffix", "other"])
def test_out_may_alias_either_input(alias: str) -> None:
    out_a, out_b = torch.randn(6, H, D), torch.randn(6, H, D)
    lse_a, lse_b = torch.randn(H, 6), torch.randn(H, 6)
    expected, expected_lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    a, b = out_a.clone(), out_b.clone()
    target = {"prefix": a, "suffix": b, "other": torch.empty_like(a)}[alias]
    out, lse = merge_attn_states(a, lse_a, b, lse_b, out=target)
    assert out is target
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)


def test_bf16_outputs_and_float32_out_buffer() -> None:
    out_a, out_b = torch.randn(6, H, D).bfloat16(), torch.randn(6, H, D).bfloat16()
    lse_a, lse_b = torch.randn(H, 6), torch.randn(H, 6)
    merged, _ = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert merged.dtype == torch.bfloat16
    buf = torch.empty(6, H, D)
    out, _ = merge_attn_states(out_a, lse_a, out_b, lse_b, out=buf)
    assert out is buf
    torch.testing.assert_close(buf.bfloat16(), merged, atol=1e-2, rtol=1e-2)


def test_merge_is_symmetric() -> None:
    out_a, out_b = torch.randn(6, H, D), torch.randn(6, H, D)
    lse_a, lse_b = torch.randn(H, 6), torch.randn(H, 6)
    ab = merge_attn_states(out_a, lse_a, out_b, lse_b)
    ba = merge_attn_states(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(ab[0], ba[0])
    torch.testing.assert_close(ab[1], ba[1])


@pytest.mark.parametrize(("change", "message"), [
    ("suffix_shape", "suffix_out shape"),
    ("lse_layout", r"prefix_lse shape: expected \[3, 6\] \(\[H, T\]\)"),
    ("out_shape", "out: expected a floating tensor of shape"),
    ("dtype_mix", "outputs must share a floating dtype"),
])
def test_bad_inputs_raise_value_error(change: str, message: str) -> None:
    a, b = torch.randn(6, H, D), torch.randn(6, H, D)
    la, lb = torch.randn(H, 6), torch.randn(H, 6)
    out = None
    if change == "suffix_shape":
        b = torch.randn(5, H, D)
    elif change == "lse_layout":
        la = torch.randn(6, H)
    elif change == "out_shape":
        out = torch.empty(6, H, D + 1)
    else:
        b = b.half()
    with pytest.raises(ValueError, match=message):
        merge_attn_states(a, la, b, lb, out=out)


@pytest.mark.parametrize("name", ["prefix_out", "suffix_lse", "out"])
def test_an_argument_that_is_not_a_tensor_gets_a_type_error(name: str) -> None:
    args: dict[str, object] = {"prefix_out": torch.randn(6, H, D), "prefix_lse": torch.randn(H, 6),
                               "suffix_out": torch.randn(6, H, D), "suffix_lse": torch.randn(H, 6),
                               "out": None}
    args[name] = [[0.0]]
    with pytest.raises(TypeError, match=f"merge_attn_states: {name} must be a torch.Tensor, "
                                        "got list"):
        merge_attn_states(**args)  # type: ignore[arg-type]


def test_flashinfer_path_refused_on_cpu() -> None:
    a = torch.randn(2, H, 128).bfloat16()
    la = torch.randn(H, 2)
    with pytest.raises(ValueError, match="use_flashinfer=True needs"):
        merge_attn_states(a, la, a, la, use_flashinfer=True)


_lse_value = st.one_of(st.just(-math.inf), st.floats(-60, 60, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_lse_value, _lse_value), min_size=1, max_size=8))
def test_never_nan_and_weights_are_convex(pairs: list[tuple[float, float]]) -> None:
    n = len(pairs)
    lse_a = torch.tensor([p[0] for p in pairs]).view(1, n)
    lse_b = torch.tensor([p[1] for p in pairs]).view(1, n)
    out_a = torch.where(torch.isneginf(lse_a).view(n, 1, 1), 0.0, 1.0).expand(n, 1, 2)
    out_b = torch.where(torch.isneginf(lse_b).view(n, 1, 1), 0.0, -1.0).expand(n, 1, 2)
    out, lse = merge_attn_states(out_a.contiguous(), lse_a, out_b.contiguous(), lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert bool((out.abs() <= 1.0 + 1e-6).all())
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    assert torch.equal(torch.isneginf(lse), both_empty)
    finite = ~both_empty
    expected = torch.logaddexp(lse_a, lse_b)
    torch.testing.assert_close(lse[finite], expected[finite])


def test_flashinfer_merge_errors_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12 item 9: a failing flashinfer merge (out of memory is a RuntimeError) reaches
    the caller every time instead of switching to torch for good."""
    import app.backends.merge as merge_mod

    def boom(*args: object, **kwargs: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory (pretend)")

    monkeypatch.setattr(merge_mod, "_can_use_flashinfer", lambda *args: True)
    monkeypatch.setattr(merge_mod, "_merge_flashinfer", boom)
    out = torch.randn(4, 2, 64, dtype=torch.float16)
    lse = torch.randn(2, 4)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            merge_attn_states(out, lse, out.clone(), lse.clone())
