"""CPU_MLA and TORCH_SDPA on FP8 latent caches (issue 36): per output element, against the
float64 decode of the latent *before* it was quantised, inside what e4m3 with the cache's
scales allows (``app.testing.fp8_bounds``); against the float64 decode of what the cache
holds, inside the kernel's own arithmetic; the conformance kit's FP8 cases, and that they
catch a reader that takes the wrong scale."""

from __future__ import annotations

import functools

import pytest
import torch

from app.backends.decode.cpu_mla import CpuMLADecodeBackend, decode_kernel_status, has_bf16_dot
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.kvcache.cache_dtypes import (
    dequantize_fp8_ds_mla,
    ds_mla_scales,
    fp8_power_of_two_scale,
    quantize_fp8_ds_mla,
    quantize_fp8_per_layer,
)
from app.testing import run_decode_conformance
from app.testing.decode_conformance import _vllm_ds_mla
from app.testing.fp8_bounds import fp8_cache_decode_bounds

LENS, QLEN, HEADS, RANK, ROPE, BLOCK, SCALE = [9, 700, 333, 64], 2, 16, 512, 64, 16, 0.07

needs_kernel = pytest.mark.skipif(not decode_kernel_status()[0].available,
                                  reason="the native CPU decode kernel is unavailable here")


@functools.cache
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """``(latent [blocks, 16, 576] float32, block table)``: the latent with tiles of very
    different sizes (the per-128 scales matter) and some tiny values (e4m3 subnormals)."""
    gen = torch.Generator().manual_seed(3)
    needed = [(n + BLOCK - 1) // BLOCK for n in LENS]
    table = torch.randperm(sum(needed), generator=gen).to(torch.int32)
    rows = torch.full((len(LENS), max(needed)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(needed):
        rows[b, :n] = table[at:at + n]
        at += n
    latent = torch.randn(sum(needed), BLOCK, RANK + ROPE, generator=gen)
    latent[..., :RANK] *= torch.tensor([0.05, 1.0, 6.0, 0.3]).repeat_interleave(128)
    latent[..., 3::97] *= 1e-3
    return latent, rows


def _cache(fmt: str) -> tuple[torch.Tensor, str, float]:
    """``(stored cache, backend cache dtype, k_scale)`` for a writer."""
    latent, _ = _data()
    if fmt == "fp8":
        scale = float(fp8_power_of_two_scale(latent.abs().amax()))
        return quantize_fp8_per_layer(latent, scale)[0], "fp8", scale
    if fmt == "ds_mla":
        return quantize_fp8_ds_mla(latent, RANK), "fp8_ds_mla", 1.0
    return _vllm_ds_mla(latent, RANK), "fp8_ds_mla", 1.0     # vLLM's amax / 448 scales


def _run(cls: type, fmt: str, q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    cache, name, k_scale = _cache(fmt)
    _, table = _data()
    q = torch.randn(len(LENS), QLEN, HEADS, RANK + ROPE,
                    generator=torch.Generator().manual_seed(4)).to(q_dtype)
    backend = cls(HEADS, SCALE, RANK, ROPE, name)
    backend.prepare_metadata(table, torch.tensor(LENS, dtype=torch.int32), QLEN)
    out, lse = backend.run_decode(q, cache, return_softmax_lse=True,
                                  k_scale=k_scale if name == "fp8" else None)
    return q, out, lse


KERNELS = [
    # (backend, q dtype, dequantised into, probabilities rounded to, divides by rounded sum)
    pytest.param(CpuMLADecodeBackend, torch.bfloat16, torch.bfloat16, torch.bfloat16, True,
                 id="cpu_mla-dot", marks=[needs_kernel, pytest.mark.skipif(
                     not has_bf16_dot(), reason="no AVX512-BF16 dot products here")]),
    pytest.param(CpuMLADecodeBackend, torch.float32, torch.float32, None, False,
                 id="cpu_mla-float", marks=needs_kernel),
    pytest.param(TorchSDPADecodeBackend, torch.float32, torch.float32, None, False,
                 id="torch_sdpa"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "ds_mla", "vllm_ds_mla"])
@pytest.mark.parametrize(("cls", "q_dtype", "dequant", "probs", "rounded"), KERNELS)
def test_the_error_against_float64_of_the_latent_is_what_e4m3_allows(
        cls: type, q_dtype: torch.dtype, dequant: torch.dtype, probs: torch.dtype | None,
        rounded: bool, fmt: str) -> None:
    latent, table = _data()
    cache, name, k_scale = _cache(fmt)
    q, out, lse = _run(cls, fmt, q_dtype)
    common = {"dequant_dtype": dequant, "probability_dtype": probs, "output_dtype": q_dtype,
              "scale_rounded": False, "rounded_normaliser": rounded,
              "kv_cache_format": "fp8_ds_mla" if name == "fp8_ds_mla" else "auto",
              "floor": 1e-4 if q_dtype == torch.bfloat16 else 2e-5}
    full = fp8_cache_decode_bounds(q.float(), cache, table, LENS, RANK, SCALE, k_scale,
                                   original=latent, **common)
    out_ratio, lse_ratio = full.worst_ratios(out, lse)
    # inside, and not vacuous: e4m3's own 2^-4 is most of the error and most of the bound
    assert out_ratio <= 1.0 and lse_ratio <= 1.0, (out_ratio, lse_ratio)
    assert max(out_ratio, lse_ratio) > 0.05, (out_ratio, lse_ratio)
    # against what the cache holds, only the kernel's arithmetic is left, and far less
    held = fp8_cache_decode_bounds(q.float(), cache, table, LENS, RANK, SCALE, k_scale,
                                   **common)
    assert max(held.worst_ratios(out, lse)) <= 1.0
    assert float(held.lse.max()) < float(full.lse.max()) / 10


def test_the_dot_path_is_exact_on_power_of_two_scales() -> None:
    """e4m3 times a power of two is a bf16 value: the package's writer costs the dot path no
    dequantisation rounding, vLLM's amax / 448 one rounding per product (still bounded)."""
    latent, _ = _data()
    ours = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(latent, RANK), RANK, ROPE)
    assert torch.equal(ours, ours.bfloat16().float())
    theirs_rows = _vllm_ds_mla(latent, RANK)
    theirs = dequantize_fp8_ds_mla(theirs_rows, RANK, ROPE)
    assert not torch.equal(theirs, theirs.bfloat16().float())
    mantissa, _ = torch.frexp(ds_mla_scales(theirs_rows, RANK, ROPE))
    assert bool((mantissa != 0.5).any())


@needs_kernel
def test_cpu_mla_and_torch_sdpa_agree_on_fp8_caches() -> None:
    for fmt in ("fp8", "ds_mla", "vllm_ds_mla"):
        _, out_c, lse_c = _run(CpuMLADecodeBackend, fmt, torch.float32)
        _, out_t, lse_t = _run(TorchSDPADecodeBackend, fmt, torch.float32)
        torch.testing.assert_close(out_c, out_t, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(lse_c, lse_t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [pytest.param(CpuMLADecodeBackend, marks=needs_kernel),
                                 TorchSDPADecodeBackend])
@pytest.mark.slow
def test_the_kit_s_fp8_cases_pass(cls: type, dtype: torch.dtype) -> None:
    report = run_decode_conformance(cls, dtype=dtype, cases=["fp8_cache", "fp8_ds_mla_cache"])
    assert report.passed and len(report.cases) == 2, report.format()


class _FirstTileScale(TorchSDPADecodeBackend):
    """A reader that takes the first tile's scale for every tile (a layout bug)."""

    name = "FIRST_TILE_SCALE"

    def _run_decode(self, metadata, q, kv_cache, out, lse, softmax_scale, k_scale):  # type: ignore[no-untyped-def]
        if self.kv_cache_format == "fp8_ds_mla":
            scales = kv_cache[..., RANK:RANK + 16].clone()
            kv_cache = kv_cache.clone()
            for t in range(1, 4):
                kv_cache[..., RANK + 4 * t:RANK + 4 * t + 4] = scales[..., :4]
        super()._run_decode(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)


class _ScaleOnePercentOff(TorchSDPADecodeBackend):
    """A reader whose per-layer scale is 1% off."""

    name = "SCALE_OFF"

    def _run_decode(self, metadata, q, kv_cache, out, lse, softmax_scale, k_scale):  # type: ignore[no-untyped-def]
        super()._run_decode(metadata, q, kv_cache, out, lse, softmax_scale, k_scale * 1.01)


def test_the_kit_catches_a_wrong_tile_scale_and_a_scale_one_percent_off() -> None:
    report = run_decode_conformance(_FirstTileScale, dtype=torch.float32,
                                    cases=["fp8_ds_mla_cache"])
    assert not report.passed and "beyond the FP8 bounds" in report.format()
    report = run_decode_conformance(_ScaleOnePercentOff, dtype=torch.float32,
                                    cases=["fp8_cache"])
    assert not report.passed and "beyond the FP8 bounds" in report.format()
