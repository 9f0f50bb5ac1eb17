"""TORCH_SDPA decode: the conformance kit on every cache dtype, and its shape rules."""

from __future__ import annotations

import pytest
import torch

from app._types import MLADimensions
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend, decode_one_request
from app.testing import assert_decode_conformance


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_sdpa_decode_conforms(dtype: torch.dtype) -> None:
    assert_decode_conformance(TorchSDPADecodeBackend, device="cpu", dtype=dtype, num_heads=8)


def test_name_and_declarations() -> None:
    assert TorchSDPADecodeBackend.get_name() == "TORCH_SDPA"
    assert TorchSDPADecodeBackend.supports_block_size(7)
    assert TorchSDPADecodeBackend.supports_mla_dimensions(MLADimensions(kv_lora_rank=256,
                                                                         qk_rope_head_dim=32))


def test_hidden_non_finite_key_stays_hidden() -> None:
    """0 * NaN is NaN: a NaN in a key only later rows see must not reach earlier rows."""
    q = torch.randn(3, 2, 12)
    latent = torch.randn(5, 12)
    latent[4] = float("nan")                  # seen only by row 2 (seq_len 5, query_len 3)
    out, lse = decode_one_request(q, latent, 8, 0.3, 1.0)
    assert torch.isfinite(out[:2]).all() and torch.isfinite(lse[:2]).all()
    assert not torch.isfinite(out[2]).any()
