"""Upper bounds of the backend layer: int32 prefix sums and a finite softmax scale."""

from __future__ import annotations

import math

import pytest

from app.backends import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend


@pytest.mark.parametrize("lengths", [[2**32, 5], [2**31, 0], [2**31 - 1, 1], [2**30] * 3])
def test_metadata_refuses_lengths_that_overflow_int32(lengths: list[int]) -> None:
    with pytest.raises(ValueError, match=r"query_lens: \d+ tokens in all; the int32 prefix sums"):
        MLAPrefillMetadata.build(lengths)


def test_metadata_refuses_context_and_kv_overflow() -> None:
    with pytest.raises(ValueError, match=r"context_chunk_lens\[0\]: \d+ tokens"):
        MLAPrefillMetadata.build([1, 1], [[2**31, 0]])
    with pytest.raises(ValueError, match=r"new_kv_lens: \d+ tokens"):
        MLAPrefillMetadata.build([1, 1], new_kv_lens=[1, 2**31])


def test_metadata_at_the_int32_limit_is_exact() -> None:
    md = MLAPrefillMetadata.build([2**31 - 2, 1])
    assert md.cu_seqlens_q_cpu.tolist() == [0, 2**31 - 2, 2**31 - 1]
    assert md.total_q == 2**31 - 1


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, 0.0, -0.1, 10**400, True,
                                   "0.1"])
def test_backend_refuses_a_non_finite_or_non_positive_scale(scale: object) -> None:
    with pytest.raises(ValueError, match="scale must be a positive, finite float"):
        TorchSDPABackend(num_heads=2, scale=scale, kv_lora_rank=16,  # type: ignore[arg-type]
                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
