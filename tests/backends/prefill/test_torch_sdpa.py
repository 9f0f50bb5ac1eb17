"""TORCH_SDPA on CPU: the conformance kit on every path, and the input checks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from app._types import DeviceCapability
from app.backends.prefill.base import ContextChunkMetadata, MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend, cpu_compute_dtype
from app.testing import assert_conformance, reference_attention

H = 4


def make(cls: type[TorchSDPABackend] = TorchSDPABackend) -> TorchSDPABackend:
    return cls(num_heads=H, scale=1 / math.sqrt(192), kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128)


def variant(**attrs: Any) -> type[TorchSDPABackend]:
    return type("TorchSDPAVariant", (TorchSDPABackend,), attrs)


#: The aten-kernel paths, which run where the native kernel cannot (tested on every machine).
ATEN = {"cpu_native_kernel": False}


@pytest.mark.parametrize("native", [True, False], ids=["default", "aten"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conforms(dtype: torch.dtype, native: bool) -> None:
    assert_conformance(TorchSDPABackend if native else variant(**ATEN), dtype=dtype)


@pytest.mark.slow
def test_conforms_on_a_long_causal_request() -> None:
    assert_conformance(TorchSDPABackend, dtype=torch.float32, long_case=True,
                       cases=["long_causal"])


@pytest.mark.parametrize("attrs", [
    {"cpu_chunked_causal_max": 0},              # one is_causal call, merged with extra keys
    {"cpu_causal_chunk": 0},                    # chunking disabled
    {"cpu_causal_chunk": 7},                    # odd chunk sizes and a short last chunk
    {"cpu_causal_chunk": 256, "cpu_chunked_causal_max": 100},
    {"cpu_blocked_rows": 0},                    # short causal calls through the aten kernel
    {"cpu_blocked_rows": 5},                    # odd plain-matmul blocks, short last block
])
def test_every_aten_cpu_path_conforms(attrs: dict[str, int]) -> None:
    assert_conformance(variant(**attrs, **ATEN), dtype=torch.float32)


@pytest.mark.parametrize(("constant", "value"), [
    ("_V_BUFFER_MAX_BYTES", 0),                 # no v buffer kept between calls
    ("_BLOCKED_HEADS", 3),                      # head groups that do not divide the heads
])
def test_aten_cpu_internal_limits_conform(monkeypatch: pytest.MonkeyPatch, constant: str,
                                          value: int) -> None:
    import app.backends.prefill._aten_cpu as module

    monkeypatch.setattr(module, constant, value)
    assert_conformance(variant(**ATEN), dtype=torch.float32)


@pytest.mark.parametrize("native", [True, False], ids=["default", "aten"])
def test_scores_far_below_the_row_max_get_no_weight(native: bool) -> None:
    """Both CPU paths clamp exp inputs (aten's plain-matmul path at -80, the native kernel
    at 2^-126); scores hundreds below the max (and masked keys) must still get no weight
    beyond float32 resolution."""
    be = make() if native else make(variant(**ATEN))
    md = MLAPrefillMetadata.build([40, 70], new_kv_lens=[40, 90])
    be.prepare_metadata(md)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(md.total_q, H, 192, generator=gen) * 6.0
    k = torch.randn(md.total_new_kv, H, 192, generator=gen) * 6.0
    v = torch.randn(md.total_new_kv, H, 128, generator=gen)
    out, lse = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, md.cu_seqlens_q_cpu.tolist(),
                                           md.cu_seqlens_kv_new_cpu.tolist(), True, be.scale)
    scores = torch.einsum("hd,khd->hk", q[39], k[:40]) * be.scale  # request 0's last row
    spread = (scores.amax(-1) - scores.amin(-1)).min().item()
    assert spread > 80  # every head has visible keys the clamp touches
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_equal_length_requests_run_batched_and_match_the_reference() -> None:
    be = make(variant(**ATEN))
    md = MLAPrefillMetadata.build([64, 64, 64, 9, 9], [[30, 30, 30, 0, 5]])
    be.prepare_metadata(md)
    assert [r[2] for r in be._step().new_tokens.runs()] == [3, 2]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(md.total_q, H, 192, generator=gen)
    k = torch.randn(md.total_q, H, 192, generator=gen)
    v = torch.randn(md.total_q, H, 128, generator=gen)
    out, lse = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, md.cu_seqlens_q_cpu.tolist(),
                                           md.cu_seqlens_q_cpu.tolist(), True, be.scale)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_dense_fallback_matches_the_reference() -> None:
    """The per-request path CUDA falls back to (run here on CPU tensors)."""
    be = make()
    md = MLAPrefillMetadata.build([5, 0, 12], new_kv_lens=[9, 3, 12])
    be.prepare_metadata(md)
    layout = be._step().new_tokens
    q = torch.randn(md.total_q, H, 192)
    k = torch.randn(md.total_new_kv, H, 192)
    v = torch.randn(md.total_new_kv, H, 128)
    out = torch.empty(md.total_q, H, 128)
    lse = torch.empty(H, md.total_q)
    be._run_dense(layout, q, k, v, True, out, lse)
    ref_out, ref_lse = reference_attention(q, k, v, md.cu_seqlens_q_cpu.tolist(),
                                           md.cu_seqlens_kv_new_cpu.tolist(), True, be.scale)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_compute_dtype_on_this_cpu() -> None:
    assert cpu_compute_dtype(torch.float32) == torch.float32
    assert cpu_compute_dtype(torch.float16) == torch.float32
    assert cpu_compute_dtype(torch.bfloat16) in (torch.bfloat16, torch.float32)


def test_empty_batch_and_all_empty_context() -> None:
    be = make()
    md = MLAPrefillMetadata.build([0, 0], [[0, 0]])
    be.prepare_metadata(md)
    q = torch.zeros(0, H, 192)
    out, lse = be.run_prefill_new_tokens(q, q, torch.zeros(0, H, 128), True)
    assert out.shape == (0, H, 128) and lse.shape == (H, 0)
    md = MLAPrefillMetadata.build([3], [[0]])
    be.prepare_metadata(md)
    out, lse = be.run_prefill_context_chunk(0, torch.randn(3, H, 192), torch.zeros(0, H, 192),
                                            torch.zeros(0, H, 128))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


# -- input checks ---------------------------------------------------------------------------

@pytest.fixture
def prepared() -> tuple[TorchSDPABackend, MLAPrefillMetadata]:
    be = make()
    md = MLAPrefillMetadata.build([3, 5], [[2, 4]])
    be.prepare_metadata(md)
    return be, md


def _qkv(tq: int = 8, tk: int = 8, heads: int = H, dqk: int = 192, dv: int = 128,
         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(tq, heads, dqk, dtype=dtype), torch.randn(tk, heads, dqk, dtype=dtype),
            torch.randn(tk, heads, dv, dtype=dtype))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tq": 7}, r"q tokens \(dim 0\): expected 8, got 7"),
    ({"tk": 9}, r"k tokens \(dim 0\): expected 8, got 9"),
    ({"heads": 2}, r"q heads \(dim 1\): expected 4, got 2"),
    ({"dqk": 128}, r"q head dim \(dim 2\): expected 192, got 128"),
    ({"dv": 192}, r"v head dim \(dim 2\): expected 128, got 192"),
    ({"dtype": torch.float64}, r"q dtype: expected one of"),
])
def test_bad_shapes_raise_with_expected_and_actual(
        prepared: tuple[TorchSDPABackend, MLAPrefillMetadata], kwargs: dict[str, Any],
        message: str) -> None:
    be, _ = prepared
    with pytest.raises(ValueError, match=message):
        be.run_prefill_new_tokens(*_qkv(**kwargs), return_softmax_lse=True)


def test_rank_dtype_mismatch_and_out_checks(
        prepared: tuple[TorchSDPABackend, MLAPrefillMetadata]) -> None:
    be, _ = prepared
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="rank 3"):
        be.run_prefill_new_tokens(q.flatten(1), k, v, True)
    with pytest.raises(ValueError, match=r"k dtype: expected torch.float32 \(as q\)"):
        be.run_prefill_new_tokens(q, k.half(), v, True)
    with pytest.raises(ValueError, match=r"out shape: expected \[8, 4, 128\], got \[8, 4, 64\]"):
        be.run_prefill_new_tokens(q, k, v, True, out=torch.empty(8, H, 64))
    with pytest.raises(ValueError, match="out dtype"):
        be.run_prefill_new_tokens(q, k, v, True, out=torch.empty(8, H, 128,
                                                                  dtype=torch.float16))
    with pytest.raises(ValueError, match=r"k tokens \(dim 0\): expected 6"):
        be.run_prefill_context_chunk(0, q, k, v)
    with pytest.raises(ValueError, match=r"context chunk index must be in \[0, 1\)"):
        be.run_prefill_context_chunk(1, q, k[:6], v[:6])
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        be.run_prefill_new_tokens(q, "k", v, True)  # type: ignore[arg-type]


def test_non_contiguous_out_is_filled() -> None:
    be = make()
    md = MLAPrefillMetadata.build([6, 2])
    be.prepare_metadata(md)
    q, k, v = _qkv()
    buf = torch.zeros(H, 8, 128).transpose(0, 1)
    out, _ = be.run_prefill_new_tokens(q, k, v, True, out=buf)
    assert out is buf
    ref, _ = reference_attention(q, k, v, [0, 6, 8], [0, 6, 8], True, be.scale)
    torch.testing.assert_close(buf.double(), ref, atol=1e-5, rtol=1e-5)


def test_run_before_prepare_metadata() -> None:
    with pytest.raises(ValueError, match="prepare_metadata"):
        make().run_prefill_new_tokens(*_qkv(), return_softmax_lse=False)


def _bad_metadata(cu_q: list[int], cu_kv: list[int], **overrides: int) -> MLAPrefillMetadata:
    q = torch.tensor(cu_q, dtype=torch.int32)
    kv = torch.tensor(cu_kv, dtype=torch.int32)
    fields: dict[str, Any] = {
        "cu_seqlens_q": q, "cu_seqlens_q_cpu": q, "max_query_len": 4, "total_q": cu_q[-1],
        "cu_seqlens_kv_new": kv, "cu_seqlens_kv_new_cpu": kv, "max_new_kv_len": 4,
        "total_new_kv": cu_kv[-1]}
    fields.update(overrides)
    return MLAPrefillMetadata(**fields)


@pytest.mark.parametrize(("md", "message"), [
    (_bad_metadata([0, 4, 2], [0, 4, 2]), "non-decreasing prefix sums, got 4 then 2"),
    (_bad_metadata([1, 4], [0, 4]), "expected to start at 0, got 1"),
    (_bad_metadata([0, 4], [0, 4], total_q=5), "expected to end at the token count 5, got 4"),
    (_bad_metadata([0, 4, 8], [0, 4]), r"expected 3 entries \(batch 2 \+ 1\), got 2"),
    (_bad_metadata([0, 4, 8], [0, 4, 8], max_query_len=3), "max query length is 4"),
])
def test_inconsistent_cu_seqlens_are_rejected(md: MLAPrefillMetadata, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make().prepare_metadata(md)


def test_device_copy_must_be_int32_like_the_host_copy() -> None:
    md = MLAPrefillMetadata.build([2, 2])
    bad = MLAPrefillMetadata(
        cu_seqlens_q=md.cu_seqlens_q.long(), cu_seqlens_q_cpu=md.cu_seqlens_q_cpu,
        max_query_len=2, total_q=4, cu_seqlens_kv_new=md.cu_seqlens_kv_new,
        cu_seqlens_kv_new_cpu=md.cu_seqlens_kv_new_cpu, max_new_kv_len=2, total_new_kv=4,
        context_chunks=(ContextChunkMetadata(torch.zeros(3, dtype=torch.int32),
                                             torch.zeros(3, dtype=torch.int32), 0, 0),))
    with pytest.raises(ValueError, match="kernels need int32 prefix sums"):
        make().prepare_metadata(bad)


# -- the CUDA path's logic, on CPU with stand-ins for torch's CUDA kernels -------------------

def _fake_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                cu_k: torch.Tensor, max_q: int, max_k: int, dropout: float, causal: bool,
                debug: bool, *, scale: float) -> tuple[torch.Tensor, ...]:
    if v.shape[-1] != q.shape[-1] or dropout != 0.0:
        raise RuntimeError("flash: v must be padded to the q/k head dim, no dropout")
    out, lse = reference_attention(q, k, v, cu_q.tolist(), cu_k.tolist(), causal, scale)
    lse[torch.isneginf(lse)] = float("inf")  # FA2 writes +inf on rows that see no key
    empty = torch.empty(0)
    return out.to(q.dtype), lse.float(), empty, empty, empty


def _fake_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: object,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                    dropout: float, mask_type: int, want_lse: bool, *, scale: float
                    ) -> tuple[object, ...]:
    if q.dim() != 4 or q.shape[0] != 1 or mask_type not in (0, 2) or not want_lse:
        raise RuntimeError("efficient: [1, T, H, D] inputs, mask type 0 or 2, with LSE")
    cq = cu_q.tolist()
    out, lse = reference_attention(q[0], k[0], v[0], cq, cu_k.tolist(), mask_type == 2, scale)
    padded = torch.full((len(cq) - 1, q.shape[2], -(-max_q // 32) * 32), 7.0)
    for b in range(len(cq) - 1):
        padded[b, :, :cq[b + 1] - cq[b]] = lse[:, cq[b]:cq[b + 1]].float()
    return out.to(q.dtype).unsqueeze(0), padded, None, None, max_q, max_k


def _failing(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("not built with this kernel")


class CudaPathOnCpu(TorchSDPABackend):
    def _launch(self, call: int, layout: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: Any) -> None:
        self._run_cuda(layout, q, k, v, causal, out, lse)


@pytest.mark.parametrize(("kernel", "cap", "dtype"), [
    ("flash", DeviceCapability(9, 0), torch.bfloat16),
    ("efficient", DeviceCapability(9, 0), torch.float32),
    ("efficient", DeviceCapability(7, 5), torch.bfloat16),
    ("dense", DeviceCapability(3, 7), torch.bfloat16),
    ("dense", DeviceCapability(3, 7), torch.float32),
])
def test_cuda_path_logic_conforms(monkeypatch: pytest.MonkeyPatch, kernel: str,
                                  cap: DeviceCapability, dtype: torch.dtype) -> None:
    # The path is decided from the capability passed in; the kernels not chosen must not run.
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward",
                        _fake_flash if kernel == "flash" else _failing)
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward",
                        _fake_efficient if kernel == "efficient" else _failing)
    backend = CudaPathOnCpu(num_heads=2, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, device_capability=cap)
    assert backend.cuda_kernel(dtype) == kernel
    assert_conformance(CudaPathOnCpu, dtype=dtype, device_capability=cap)


def _out_of_memory(*args: Any, **kwargs: Any) -> Any:
    raise torch.OutOfMemoryError("CUDA out of memory (pretend)")


@pytest.mark.parametrize("kernel", ["_flash_attention_forward", "_efficient_attention_forward"])
def test_cuda_kernel_errors_propagate(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Issue 12 item 9: an out-of-memory error is a RuntimeError; it must reach the caller, not
    switch the backend to a slower path for good."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _out_of_memory)
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward",
                        _out_of_memory if kernel.startswith("_eff") else _fake_efficient)
    dtype = torch.bfloat16 if kernel.startswith("_flash") else torch.float32
    backend = CudaPathOnCpu(num_heads=2, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128,
                            device_capability=DeviceCapability(9, 0))
    backend.prepare_metadata(MLAPrefillMetadata.build([8]))
    q = torch.randn(8, 2, 192, dtype=dtype)
    v = torch.randn(8, 2, 128, dtype=dtype)
    for _ in range(2):  # and again: nothing was switched off by the first failure
        with pytest.raises(torch.OutOfMemoryError):
            backend.run_prefill_new_tokens(q, q, v, return_softmax_lse=True)
