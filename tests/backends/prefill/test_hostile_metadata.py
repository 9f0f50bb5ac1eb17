"""Hostile prefill metadata (issue 21): int64 prefix sums beyond int32 are refused, not narrowed
to the kernels' int32, and the layout keeps its own host copies of what it checked."""

from __future__ import annotations

import pytest
import torch

from app.backends.prefill.base import MLAPrefillMetadata
from app.backends.prefill.kernel_base import check_cu_seqlens
from app.backends.prefill.torch_sdpa import TorchSDPABackend


def _backend() -> TorchSDPABackend:
    return TorchSDPABackend(num_heads=2, scale=0.1, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8)


def test_int64_prefix_sums_beyond_int32_are_refused() -> None:
    host = torch.tensor([0, 2**32 + 4], dtype=torch.int64)   # narrowed to int32: [0, 4]
    narrowed = host.to(torch.int32)
    md = MLAPrefillMetadata(
        cu_seqlens_q=narrowed, cu_seqlens_q_cpu=host, max_query_len=2**32 + 4,
        total_q=2**32 + 4, cu_seqlens_kv_new=narrowed, cu_seqlens_kv_new_cpu=host,
        max_new_kv_len=2**32 + 4, total_new_kv=2**32 + 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: ends at 4294967300, beyond int32 "
                                         r"\(at most 2147483647 tokens in all\)"):
        _backend().prepare_metadata(md)


def test_check_cu_seqlens_takes_int64_within_int32() -> None:
    assert check_cu_seqlens(torch.tensor([0, 3, 2**31 - 1]), "cu") == [0, 3, 2**31 - 1]


def test_the_layout_keeps_its_own_host_copies() -> None:
    md = MLAPrefillMetadata.build([3, 5])
    be = _backend()
    be.prepare_metadata(md)
    md.cu_seqlens_q_cpu.fill_(7)            # the caller reuses its buffer
    q = torch.randn(8, 2, 12)
    k = torch.randn(8, 2, 12)
    v = torch.randn(8, 2, 8)
    out, _ = be.run_prefill_new_tokens(q, k, v, True)
    ref = _backend()
    ref.prepare_metadata(MLAPrefillMetadata.build([3, 5]))
    expected, _ = ref.run_prefill_new_tokens(q, k, v, True)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("shared", ["q", "k", "v"])
def test_an_out_sharing_memory_with_an_input_gets_the_right_result(shared: str) -> None:
    be = TorchSDPABackend(num_heads=2, scale=0.1, kv_lora_rank=16, qk_nope_head_dim=48,
                          qk_rope_head_dim=16, v_head_dim=64)
    be.prepare_metadata(MLAPrefillMetadata.build([40, 24]))
    gen = torch.Generator().manual_seed(0)
    inputs = {name: torch.randn(64, 2, 64, generator=gen) for name in ("q", "k", "v")}
    expected, _ = be.run_prefill_new_tokens(*inputs.values(), True)
    buf = torch.cat([inputs[shared].reshape(-1), torch.zeros(1024)])
    inputs[shared] = buf[:64 * 128].view(64, 2, 64)
    out = buf[512:512 + 64 * 128].view(64, 2, 64)  # overlaps the input, shifted by 2 rows
    result, _ = be.run_prefill_new_tokens(*inputs.values(), True, out=out)
    assert result is out
    torch.testing.assert_close(result, expected)


def test_the_kernels_read_the_checked_values_not_the_callers_device_copy() -> None:
    # A device copy that disagrees with the host one (a hand-built metadata, or a buffer the
    # caller reused) was handed to the GPU kernels unchecked.
    md = MLAPrefillMetadata.build([3, 5])
    bad_device = torch.tensor([0, 7, 8], dtype=torch.int32)   # says 7 + 1, the host 3 + 5
    be = _backend()
    be.prepare_metadata(MLAPrefillMetadata(
        cu_seqlens_q=bad_device, cu_seqlens_q_cpu=md.cu_seqlens_q_cpu, max_query_len=5,
        total_q=8, cu_seqlens_kv_new=bad_device, cu_seqlens_kv_new_cpu=md.cu_seqlens_kv_new_cpu,
        max_new_kv_len=5, total_new_kv=8))
    layout = be._step().new_tokens
    assert layout.cu_q.tolist() == [0, 3, 8] and layout.cu_kv.tolist() == [0, 3, 8]
    for t in (layout.cu_q, layout.cu_kv, layout.cu_q_cpu, layout.cu_kv_cpu):
        assert t.untyped_storage().data_ptr() not in (
            bad_device.untyped_storage().data_ptr(),
            md.cu_seqlens_q_cpu.untyped_storage().data_ptr())
