"""Hostile tensors, flags and steps in the prefill contract (TORCH_SDPA, whose CPU path runs
the native kernel): each is refused with a typed error before any kernel runs, or gives the
right result; a refused step changes nothing.

- An ``out=`` over ``q`` through a second storage object (``from_numpy``) was written while
  the kernel still read ``q``: a silent wrong result.
- A step refused by ``prepare_metadata`` was kept as the metadata while the layouts stayed the
  previous step's: the next run used the old layout silently, or raised ``IndexError``.
- A list for ``q`` raised ``AttributeError``; a sparse ``q`` and an ``out=`` with elements that
  share memory raised torch's ``RuntimeError`` (the latter after the kernel had run); a truthy
  string for ``return_softmax_lse`` was taken as True; ``build(device="nope")`` raised
  ``RuntimeError``; a scale of 1e300 gave inf/NaN outputs.
- A negative view (``conj().imag``) of ``k`` was read as raw memory: its values with the sign
  lost.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.backends.prefill.base import ContextChunkMetadata, MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend

H, QK, DV = 2, 64, 64


def _backend(scale: float = 0.1) -> TorchSDPABackend:
    return TorchSDPABackend(num_heads=H, scale=scale, kv_lora_rank=16, qk_nope_head_dim=48,
                            qk_rope_head_dim=16, v_head_dim=DV)


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(tokens, H, QK, generator=gen), torch.randn(tokens, H, QK, generator=gen),
            torch.randn(tokens, H, DV, generator=gen))


def test_an_out_over_q_through_another_storage_gets_the_right_result() -> None:
    be = _backend()
    be.prepare_metadata(MLAPrefillMetadata.build([40, 24]))
    q, k, v = _inputs(64)
    expected, _ = be.run_prefill_new_tokens(q, k, v, True)
    buf = np.zeros(2 * q.numel(), dtype=np.float32)
    q_in = torch.from_numpy(buf[:q.numel()]).view(q.shape)
    q_in.copy_(q)
    out = torch.from_numpy(buf[4 * H * QK:4 * H * QK + expected.numel()]).view(expected.shape)
    result, _ = be.run_prefill_new_tokens(q_in, k, v, True, out=out)
    assert result is out
    torch.testing.assert_close(result, expected)


def test_a_refused_step_leaves_the_previous_one() -> None:
    be = _backend()
    good = MLAPrefillMetadata.build([10, 20], context_chunk_lens=[[5, 7]])
    be.prepare_metadata(good)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    past_end = torch.tensor([0, 5, 99], dtype=torch.int32)   # says 94 tokens, totals 12
    bad = MLAPrefillMetadata(cu, cu, 20, 30, cu, cu, 20, 30, (
        good.context_chunks[0], ContextChunkMetadata(past_end, past_end, 94, 12)))
    with pytest.raises(ValueError):
        be.prepare_metadata(bad)
    assert be.metadata is good
    q, k, v = _inputs(30)
    out, lse = be.run_prefill_context_chunk(0, q, k[:12], v[:12])
    assert out.shape == (30, H, DV) and lse.shape == (H, 30)
    with pytest.raises(ValueError, match=r"context chunk index must be in \[0, 1\)"):
        be.run_prefill_context_chunk(1, q, k[:12], v[:12])


def test_bad_arguments_get_typed_errors_before_the_kernel() -> None:
    be = _backend()
    be.prepare_metadata(MLAPrefillMetadata.build([8]))
    q, k, v = _inputs(8)
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor, got list"):
        be.run_prefill_new_tokens(q.tolist(), k, v, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"q: expected a dense \(torch.strided\) tensor"):
        be.run_prefill_new_tokens(q.to_sparse(), k, v, True)
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool, got 'no'"):
        be.run_prefill_new_tokens(q, k, v, "no")  # type: ignore[arg-type]
    expanded = torch.zeros(1, 1, DV).expand(8, H, DV)
    with pytest.raises(ValueError, match="out must not have elements that share memory"):
        be.run_prefill_new_tokens(q, k, v, False, out=expanded)
    with pytest.raises(ValueError, match="out must not require grad"):
        be.run_prefill_new_tokens(q, k, v, False, out=torch.zeros(8, H, DV, requires_grad=True))
    with pytest.raises(ValueError, match=r"device must be a torch\.device or a device string"):
        MLAPrefillMetadata.build([8], device="nope")
    with pytest.raises(ValueError, match="scale must be a positive, finite float in"):
        _backend(scale=1e300)


def test_negative_views_read_as_their_values() -> None:
    be = _backend()
    be.prepare_metadata(MLAPrefillMetadata.build([40, 24]))
    q, k, v = _inputs(64)
    expected, _ = be.run_prefill_new_tokens(q, k, v, True)
    for i in range(3):
        args = [q, k, v]
        z = torch.view_as_complex((-args[i]).reshape(-1, 2))
        args[i] = z.conj().imag.as_strided(args[i].shape, args[i].stride(), 0)
        assert args[i].is_neg()
        got, _ = be.run_prefill_new_tokens(args[0], args[1], args[2], True)
        torch.testing.assert_close(got, expected)
