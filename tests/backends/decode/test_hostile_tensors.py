"""Hostile tensors and scales in ``run_decode`` for every CPU decode backend: each is either
refused with a typed error before any kernel runs, or gives the right result.

- An ``out=`` over the same memory as ``q`` through a second storage object (``from_numpy``,
  ``frombuffer``, DLPack) was written while the kernel still read ``q``: a silent wrong result.
- An ``out=`` whose elements share memory, that requires grad, or an inference tensor, reached
  torch's ``RuntimeError`` in ``out.copy_`` after the kernel had run.
- Sparse and meta tensors reached torch's ``RuntimeError`` / ``NotImplementedError``.
- Scales finite in float64 but not in float32 (``1e39``) gave NaN outputs.
- A negative view (``conj().imag``) was read as raw memory by the native kernel: its values
  with the sign lost.
- The native softmax gave a key far below its row's max a weight of 2^-126, not 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.backends.decode.base import MLADecodeBackend
from tests.backends.decode._cpu_support import BACKENDS, BS, HEADS, NUM_BLOCKS, RANK, ROPE


def _step(cls: type[MLADecodeBackend]) -> tuple[MLADecodeBackend, torch.Tensor, torch.Tensor]:
    be = cls(num_heads=HEADS, scale=0.1, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
             kv_cache_dtype=torch.float32)
    be.prepare_metadata(torch.tensor([[1, 2], [0, 3], [4, 5]], dtype=torch.int32),
                        torch.tensor([20, 30, 9], dtype=torch.int32), 1)
    gen = torch.Generator().manual_seed(0)
    return (be, torch.randn(3, 1, HEADS, RANK + ROPE, generator=gen),
            torch.randn(NUM_BLOCKS, BS, RANK + ROPE, generator=gen))


@pytest.mark.parametrize("cls", BACKENDS)
def test_an_out_over_q_through_another_storage_gets_the_right_result(
        cls: type[MLADecodeBackend]) -> None:
    be, _, cache = _step(cls)
    # 8 requests: each share of the batch runs its requests in order, so a request's output,
    # written over a later request's query, is read back there if the overlap is missed
    be.prepare_metadata(torch.arange(8, dtype=torch.int32).view(8, 1),
                        torch.full((8,), BS, dtype=torch.int32), 1)
    q = torch.randn(8, 1, HEADS, RANK + ROPE, generator=torch.Generator().manual_seed(1))
    expected = be.run_decode(q, cache)
    buf = np.zeros(q.numel() + expected.numel(), dtype=np.float32)
    q_in = torch.from_numpy(buf[:q.numel()]).view(q.shape)
    q_in.copy_(q)
    start = q[0].numel()       # out starts inside request 1's query: written before it is read
    out = torch.from_numpy(buf[start:start + expected.numel()]).view(expected.shape)
    assert out.untyped_storage().data_ptr() != q_in.untyped_storage().data_ptr()
    result = be.run_decode(q_in, cache, out=out)
    assert result is out
    torch.testing.assert_close(result, expected)


def _expanded_out() -> torch.Tensor:
    return torch.zeros(3, 1, 1, RANK).expand(3, 1, HEADS, RANK)


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize(("make", "message"), [
    (_expanded_out, "must not have elements that share memory"),
    (lambda: torch.zeros(3, 1, HEADS, RANK, requires_grad=True), "must not require grad"),
    (lambda: torch.zeros(3, 1, HEADS, RANK).to_sparse(), "expected a dense"),
])
def test_an_out_that_cannot_be_written_is_refused_before_the_kernel(
        cls: type[MLADecodeBackend], make: object, message: str) -> None:
    be, q, cache = _step(cls)
    out = make()  # type: ignore[operator]
    with pytest.raises((ValueError, TypeError), match=message):
        be.run_decode(q, cache, out=out)


@pytest.mark.parametrize("cls", BACKENDS)
def test_an_inference_out_is_refused_outside_inference_mode(
        cls: type[MLADecodeBackend]) -> None:
    be, q, cache = _step(cls)
    with torch.inference_mode():
        out = torch.zeros(3, 1, HEADS, RANK)
        be.run_decode(q, cache, out=out)           # inside: fine
    with pytest.raises(ValueError, match="inference tensor"):
        be.run_decode(q, cache, out=out)


@pytest.mark.parametrize("cls", BACKENDS)
def test_sparse_and_meta_inputs_get_typed_errors(cls: type[MLADecodeBackend]) -> None:
    be, q, cache = _step(cls)
    with pytest.raises(TypeError, match=r"q: expected a dense \(torch.strided\) tensor"):
        be.run_decode(q.to_sparse(), cache)
    with pytest.raises(TypeError, match="kv_cache: expected a dense"):
        be.run_decode(q, cache.to_sparse())
    with pytest.raises(ValueError, match="k_scale: expected a tensor with data"):
        be.run_decode(q, cache, k_scale=torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match="query_len: expected a tensor with data"):
        be.prepare_metadata(torch.zeros(1, 2, dtype=torch.int32),
                            torch.tensor([3], dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"softmax_scale": 1e39}, "softmax_scale must be within float32's normal range"),
    ({"k_scale": 1e39}, "k_scale must be within float32's normal range"),
    ({"softmax_scale": 1e-39}, "softmax_scale must be within float32's normal range"),
    ({"softmax_scale": 1e30, "k_scale": 1e30}, r"softmax_scale \* k_scale must be in"),
    ({"softmax_scale": 3e38}, r"softmax_scale \* k_scale must be in"),   # x log2(e): inf
])
def test_scales_beyond_float32_are_refused(cls: type[MLADecodeBackend],
                                           kwargs: dict[str, float], message: str) -> None:
    be, q, cache = _step(cls)
    with pytest.raises(ValueError, match=message):
        be.run_decode(q, cache, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale must be within float32's normal range"):
        cls(num_heads=HEADS, scale=1e39, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
            kv_cache_dtype=torch.float32)


def _negative_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor equal to ``t`` whose memory holds ``-t``: the imaginary part of a
    conjugate (negative bit set), re-strided over all of its storage."""
    z = torch.view_as_complex((-t).reshape(-1, 2))
    view = z.conj().imag.as_strided(t.shape, t.stride(), 0)
    assert view.is_neg() and torch.equal(view, t)
    return view


@pytest.mark.parametrize("cls", BACKENDS)
def test_negative_views_read_as_their_values(cls: type[MLADecodeBackend]) -> None:
    be, q, cache = _step(cls)
    expected = be.run_decode(q, cache)
    torch.testing.assert_close(be.run_decode(_negative_view(q), cache), expected)
    torch.testing.assert_close(be.run_decode(q, _negative_view(cache)), expected)
    out = _negative_view(torch.zeros_like(expected))
    result = be.run_decode(q, cache, out=out)
    assert result is out
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("cls", BACKENDS)
def test_a_key_far_below_the_max_has_no_weight(cls: type[MLADecodeBackend]) -> None:
    be = cls(num_heads=1, scale=1.0, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
             kv_cache_dtype=torch.float32)
    be.prepare_metadata(torch.zeros(1, 1, dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32), 1)
    cache = torch.zeros(1, 2, RANK + ROPE)
    cache[0, 0, :RANK] = 3e38       # score 0: e^-1000 below key 1, which scores 1000
    cache[0, 1, RANK:] = 1000.0 / ROPE
    q = torch.zeros(1, 1, 1, RANK + ROPE)
    q[..., RANK:] = 1.0
    out = be.run_decode(q, cache)
    assert torch.equal(out, torch.zeros_like(out))
