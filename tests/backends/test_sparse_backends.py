"""Sparse attention as a backend capability: TORCH_SPARSE passes the sparse kit cases, the kit
catches a backend that gets sparse attention wrong, the sparse verbs are refused where they do
not apply, and selection gives a sparse model only sparse backends (and a dense one none)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from app._types import DeviceCapability
from app.backends import (
    MLADecodeBackendEnum,
    MLADecodeSelectorConfig,
    MLAPrefillSelectorConfig,
    explain_mla_decode_selection,
    explain_mla_prefill_selection,
    get_mla_decode_backend,
    get_mla_prefill_backend,
    register_mla_decode_backend,
)
from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.decode.torch_sparse import TorchSparseDecodeBackend
from app.backends.prefill.cpu_sparse import CpuSparsePrefillBackend
from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend
from app.backends.prefill.torch_sparse import TorchSparsePrefillBackend
from app.backends.sparse.attention import sparse_attention_rows
from app.config import AttentionConfig, EngineConfig, ModelConfig
from app.containers import create_container, use_container
from app.platforms import CpuPlatform, CudaPlatform, wants_sparse
from app.testing import (
    DECODE_CASES,
    SPARSE_DECODE_CASES,
    SPARSE_PREFILL_CASES,
    run_conformance,
    run_decode_conformance,
)

SPARSE = EngineConfig(model=ModelConfig(index_topk=2048))
DENSE = EngineConfig()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_sparse_decode_passes_the_sparse_cases(dtype: torch.dtype) -> None:
    report = run_decode_conformance(TorchSparseDecodeBackend, dtype=dtype, num_heads=8)
    assert report.passed, report.format()
    assert [c.name for c in report.cases] == list(SPARSE_DECODE_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_sparse_prefill_passes_the_sparse_cases(dtype: torch.dtype) -> None:
    report = run_conformance(TorchSparsePrefillBackend, dtype=dtype)
    assert report.passed, report.format()
    assert [c.name for c in report.cases] == list(SPARSE_PREFILL_CASES)


def test_a_dense_backend_runs_no_sparse_case_and_a_sparse_one_no_dense_case() -> None:
    dense = run_decode_conformance(TorchSDPADecodeBackend, dtype=torch.float32,
                                   cases=["paged", "sparse_paged"])
    assert dense.passed and dense.cases[1].skipped is not None
    assert "sparse not supported" in dense.cases[1].skipped
    sparse = run_decode_conformance(TorchSparseDecodeBackend, dtype=torch.float32,
                                    cases=["paged", "sparse_paged"])
    assert sparse.passed and sparse.cases[0].skipped is not None
    assert "non-sparse not supported" in sparse.cases[0].skipped
    assert not set(DECODE_CASES) & set(SPARSE_DECODE_CASES)


class _NoPadding(TorchSparseDecodeBackend):
    """Reads row 0 for a -1 entry (as a kernel that forgot the padding would)."""

    def _run_sparse_decode(self, metadata, q, kv_cache, indices, out, lse, softmax_scale,
                           k_scale):  # type: ignore[no-untyped-def]
        super()._run_sparse_decode(metadata, q, kv_cache, indices.clamp(min=0), out, lse,
                                   softmax_scale, k_scale)


class _Deduplicates(TorchSparseDecodeBackend):
    """Counts a slot named twice once (the contract counts every entry)."""

    def _run_sparse_decode(self, metadata, q, kv_cache, indices, out, lse, softmax_scale,
                           k_scale):  # type: ignore[no-untyped-def]
        unique = indices.clone()
        flat = unique.view(-1, unique.shape[-1])
        for row in flat:
            seen: set[int] = set()
            for j, v in enumerate(row.tolist()):
                if v in seen:
                    row[j] = -1
                seen.add(v)
        super()._run_sparse_decode(metadata, q, kv_cache, unique, out, lse, softmax_scale,
                                   k_scale)


class _Base2Lse(TorchSparseDecodeBackend):
    """Writes the LSE in base 2 (a kernel's native one)."""

    def _run_sparse_decode(self, metadata, q, kv_cache, indices, out, lse, softmax_scale,
                           k_scale):  # type: ignore[no-untyped-def]
        super()._run_sparse_decode(metadata, q, kv_cache, indices, out, lse, softmax_scale,
                                   k_scale)
        if lse is not None:
            lse.mul_(1.4426950408889634)


class _RoundedLse(TorchSparseDecodeBackend):
    """Sums its LSE from the probabilities rounded to bf16, as CPU_MLA_SPARSE's bf16 dot path
    did (issue 44): ~6e-4 off float64, inside bf16's tolerance but not the float32 LSE."""

    def _run_sparse_decode(self, metadata, q, kv_cache, indices, out, lse, softmax_scale,
                           k_scale):  # type: ignore[no-untyped-def]
        super()._run_sparse_decode(metadata, q, kv_cache, indices, out, lse, softmax_scale,
                                   k_scale)
        if lse is None:
            return
        rows = kv_cache.reshape(-1, kv_cache.shape[-1]).float()
        idx = indices.long()
        s = torch.einsum("bqhd,bqkd->bqhk", q.float(), rows[idx.clamp(min=0)]) \
            * (softmax_scale * k_scale)
        s = s.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
        m = s.amax(-1, keepdim=True).clamp(min=-1e30)
        p = torch.exp(s - m).to(torch.bfloat16).float()
        lse.copy_(torch.where(p.sum(-1) > 0, (m.squeeze(-1) + p.sum(-1).log()), lse))


class _NoKScale(TorchSparsePrefillBackend):
    """Drops the cache scale."""

    def _run_sparse_prefill(self, q, kv, indices, out, lse, softmax_scale,
                            k_scale):  # type: ignore[no-untyped-def]
        super()._run_sparse_prefill(q, kv, indices, out, lse, softmax_scale, 1.0)


@pytest.mark.parametrize(("backend", "case"), [
    (_NoPadding, "sparse_paged"), (_Deduplicates, "sparse_repeats_padding"),
    (_Base2Lse, "sparse_query_len_4")])
def test_the_decode_kit_catches_a_wrong_sparse_backend(backend: type, case: str) -> None:
    report = run_decode_conformance(backend, dtype=torch.float32, num_heads=4, cases=[case])
    assert not report.passed, report.format()


def test_the_kit_holds_a_bf16_sparse_lse_to_the_float32_one() -> None:
    report = run_decode_conformance(_RoundedLse, dtype=torch.bfloat16, num_heads=8,
                                    cases=["sparse_long_context"])
    assert not report.passed, report.format()
    assert "must be the float32 one" in report.format()


def test_the_prefill_kit_catches_a_dropped_cache_scale() -> None:
    report = run_conformance(_NoKScale, dtype=torch.float32, cases=["sparse_scales_per_call"])
    assert not report.passed, report.format()


def _decode_step(backend: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    backend.prepare_metadata(MLADecodeMetadata.build(  # type: ignore[attr-defined]
        table, torch.tensor([20], dtype=torch.int32), 1))
    q = torch.randn(1, 1, 4, 40)
    cache = torch.randn(2, 16, 40)
    return q, cache, torch.tensor([[[3, 0, -1]]], dtype=torch.int32)


def test_sparse_and_dense_verbs_are_refused_where_they_do_not_apply() -> None:
    dense = TorchSDPADecodeBackend(4, 0.1, 32, 8, torch.float32)
    q, cache, idx = _decode_step(dense)
    with pytest.raises(TypeError, match="does not run sparse attention"):
        dense.run_sparse_decode(q, cache, idx)
    sparse = TorchSparseDecodeBackend(4, 0.1, 32, 8, torch.float32)
    q, cache, idx = _decode_step(sparse)
    with pytest.raises(TypeError, match="does not run dense attention"):
        sparse.run_decode(q, cache)
    out = sparse.run_sparse_decode(q, cache, idx)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 1, 4, 32)
    prefill = TorchSparsePrefillBackend(4, 0.1, 32, 16, 8, 16)
    with pytest.raises(TypeError, match="runs only sparse attention"):
        prefill.run_prefill_new_tokens(torch.randn(3, 4, 24), torch.randn(3, 4, 24),
                                       torch.randn(3, 4, 16), False)
    with pytest.raises(TypeError, match="does not run sparse attention"):
        TorchSDPAPrefillBackend(4, 0.1, 32, 16, 8, 16).run_sparse_prefill(
            torch.randn(2, 4, 40), torch.randn(5, 40), torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.parametrize(("indices", "message"), [
    (torch.tensor([[[32, 0, -1]]], dtype=torch.int32), "out of range"),
    (torch.tensor([[[-2, 0, -1]]], dtype=torch.int32), "out of range"),
    (torch.tensor([[[3, 0, -1]]], dtype=torch.int64), "must be int32"),
    (torch.tensor([[3, 0, -1]], dtype=torch.int32), "must be"),
    (torch.zeros(1, 1, 0, dtype=torch.int32), "topk >= 1")])
def test_bad_indices_are_refused_before_any_kernel(indices: torch.Tensor, message: str) -> None:
    sparse = TorchSparseDecodeBackend(4, 0.1, 32, 8, torch.float32)
    q, cache, _ = _decode_step(sparse)
    with pytest.raises(ValueError, match=message):
        sparse.run_sparse_decode(q, cache, indices)


def test_a_row_naming_nothing_and_nan_outside_the_selection() -> None:
    q, kv = torch.randn(3, 2, 10), torch.randn(6, 10)
    kv[5] = float("nan")                                 # never named: must not reach any row
    idx = torch.tensor([[0, 1, -1], [-1, -1, -1], [4, 4, 2]], dtype=torch.int32)
    out, lse = sparse_attention_rows(q, kv, idx, 8, 0.5)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[[0, 2]]).all()
    kv[2, 0] = float("nan")                              # named by row 2 only
    out, lse = sparse_attention_rows(q, kv, idx, 8, 0.5)
    assert torch.isnan(out[2]).any() and torch.isfinite(out[0]).all()


def test_selection_gives_a_sparse_model_only_sparse_backends() -> None:
    native = CpuSparseDecodeBackend.is_available()  # the CPU prefers the native kernels
    with use_container(create_container(SPARSE, CpuPlatform())):
        assert get_mla_decode_backend(SPARSE) is (
            CpuSparseDecodeBackend if native else TorchSparseDecodeBackend)
        assert get_mla_prefill_backend(SPARSE) is (
            CpuSparsePrefillBackend if native else TorchSparsePrefillBackend)
        for explain in (explain_mla_decode_selection(SPARSE),
                        explain_mla_prefill_selection(SPARSE)):
            assert explain["priorities"] == ["CPU_MLA_SPARSE", "TORCH_SPARSE"]
            assert explain["selector_config"]["index_topk"] == 2048
            dense_verdict = explain["backends"]["TORCH_SDPA"]
            assert not dense_verdict["valid"]
            assert dense_verdict["reasons"][-1].startswith("sparse not supported")


def test_a_dense_model_never_gets_a_sparse_only_backend() -> None:
    with use_container(create_container(DENSE, CpuPlatform())):
        explain = explain_mla_decode_selection(DENSE)
        assert explain["chosen"] != "TORCH_SPARSE"
        assert explain["backends"]["TORCH_SPARSE"]["reasons"] == [
            "non-sparse not supported: this backend runs only DeepSeek Sparse Attention and "
            "the model is dense (no index_topk)"]
    forced = EngineConfig(attention=AttentionConfig(mla_decode_backend="TORCH_SPARSE"))
    with use_container(create_container(forced, CpuPlatform())), \
            pytest.raises(ValueError, match=r"TORCH_SPARSE is not valid.*non-sparse"):
        get_mla_decode_backend(forced)
    forced_dense = EngineConfig(model=ModelConfig(index_topk=64),
                                attention=AttentionConfig(mla_decode_backend="CPU_MLA"))
    with use_container(create_container(forced_dense, CpuPlatform())), \
            pytest.raises(ValueError, match=r"CPU_MLA is not valid.*sparse not supported"):
        get_mla_decode_backend(forced_dense)


def test_an_emulated_gpu_selects_the_torch_sparse_backends() -> None:
    gpu = CudaPlatform(device_capability=DeviceCapability(9, 0))
    with use_container(create_container(SPARSE, gpu)):
        assert get_mla_decode_backend(SPARSE) is TorchSparseDecodeBackend
        assert get_mla_prefill_backend(SPARSE) is TorchSparsePrefillBackend


def test_the_selector_configs_carry_the_model_s_sparsity() -> None:
    decode = MLADecodeSelectorConfig.from_engine_config(SPARSE)
    prefill = MLAPrefillSelectorConfig.from_engine_config(SPARSE)
    assert decode.index_topk == prefill.index_topk == 2048 and decode.sparse and prefill.sparse
    assert not MLADecodeSelectorConfig.from_engine_config(DENSE).sparse
    assert wants_sparse(decode) and not wants_sparse(object())
    with pytest.raises(ValueError, match="index_topk"):
        MLAPrefillSelectorConfig(dtype=torch.bfloat16,
                                 mla_dimensions=DENSE.model.mla_dimensions, index_topk=0)


def test_the_selector_configs_hold_index_topk_to_model_config_s_range() -> None:
    """Issue 44: ``ModelConfig.index_topk`` is at most int32's largest; the selector configs,
    which carry it, refuse what it refuses."""
    with pytest.raises(ValueError, match="index_topk"):
        ModelConfig(index_topk=2**31)
    top = ModelConfig(index_topk=2**31 - 1)
    assert MLAPrefillSelectorConfig(dtype=torch.bfloat16, mla_dimensions=top.mla_dimensions,
                                    index_topk=2**31 - 1).sparse
    with pytest.raises(ValueError, match=r"index_topk \(or None\) must be an int in "
                                         r"\[1, 2147483647\], got 2147483648"):
        MLAPrefillSelectorConfig(dtype=torch.bfloat16, mla_dimensions=top.mla_dimensions,
                                 index_topk=2**31)
    with pytest.raises(ValueError, match=r"MLADecodeSelectorConfig.index_topk \(or None\)"):
        MLADecodeSelectorConfig(dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                                num_heads=16, block_size=64, index_topk=2**31)


def test_a_third_party_sparse_backend_registers_and_is_forced() -> None:
    class MySparse(TorchSparseDecodeBackend):
        name = "MY_SPARSE"

    config = EngineConfig(model=ModelConfig(index_topk=64),
                          attention=AttentionConfig(mla_decode_backend="auto"))
    with use_container(create_container(config, CpuPlatform())):
        register_mla_decode_backend("MY_SPARSE", MySparse)
        assert MLADecodeBackendEnum["MY_SPARSE"].get_class() is MySparse


def test_a_badly_typed_sparse_declaration_is_refused() -> None:
    class Bad(TorchSparseDecodeBackend):
        name = "BAD_SPARSE"
        supports_sparse: ClassVar[bool] = "yes"  # type: ignore[assignment]

    with use_container(create_container(SPARSE, CpuPlatform())), \
            pytest.raises(TypeError, match="supports_sparse = 'yes': expected a bool"):
        register_mla_decode_backend("BAD_SPARSE", Bad)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_ds_mla"])
def test_torch_sparse_decode_reads_an_fp8_cache_as_its_dequantised_values(
        kv_cache_dtype: str) -> None:
    """TORCH_SPARSE over an FP8 cache equals TORCH_SPARSE over the float32 values that
    cache holds (the named rows dequantised as they are gathered, the per-layer scale in both
    the logits and the values), NaN included; selection lists it for those cache dtypes."""
    from app.kvcache.cache_dtypes import (
        dequantize_fp8_ds_mla,
        dequantize_fp8_per_layer,
        quantize_fp8_ds_mla,
        quantize_fp8_per_layer,
    )

    torch.manual_seed(0)
    rank, rope, heads, scale = 128, 64, 4, 0.06
    latent = torch.randn(3, 16, rank + rope)
    latent[1, 2, 5] = float("nan")               # slot 18: named by request 1 only
    if kv_cache_dtype == "fp8":
        k_scale = 0.0125
        cache, _ = quantize_fp8_per_layer(latent, k_scale)
        values = dequantize_fp8_per_layer(cache, k_scale, torch.float32)
    else:
        k_scale = 1.0
        cache = quantize_fp8_ds_mla(latent, rank)
        values = dequantize_fp8_ds_mla(cache, rank, rope).float()
    table = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    lens = torch.tensor([30, 32], dtype=torch.int32)
    indices = torch.tensor([[[0, 3, 3, -1, 17]], [[18, 20, 40, -1, -1]]], dtype=torch.int32)
    q = torch.randn(2, 1, heads, rank + rope)
    fp8 = TorchSparseDecodeBackend(heads, scale, rank, rope, kv_cache_dtype)
    plain = TorchSparseDecodeBackend(heads, scale, rank, rope, torch.float32)
    for backend in (fp8, plain):
        backend.prepare_metadata(MLADecodeMetadata.build(table, lens, 1))
    out, lse = fp8.run_sparse_decode(q, cache, indices, return_softmax_lse=True,
                                     k_scale=k_scale)
    ref, ref_lse = plain.run_sparse_decode(q, values, indices, return_softmax_lse=True)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, 0], ref_lse[:, 0], rtol=1e-5, atol=1e-5)
    config = MLADecodeSelectorConfig(dtype=torch.bfloat16, kv_lora_rank=rank,
                                     qk_rope_head_dim=rope, num_heads=heads, block_size=16,
                                     kv_cache_dtype=kv_cache_dtype, index_topk=8)
    assert TorchSparseDecodeBackend.validate_configuration(None, config) == []
