"""Which unit CPU_MLA's kernel multiplies on: one rule (``kernel_paths.decode_unit``) for the
backend's choice and for the report (``kernel_path``, ``backends``, ``platform``), so they
cannot disagree; the report follows the cache dtype (FP8 rows never go to the AMX tiles);
``APP_CPU_DECODE_BF16_DOT=0`` keeps bf16 on float32 FMAs, off the AMX kernel too.

Every CPU here is faked whole (``_fake_cpu``): flags, the AMX tile permission, the libraries.
Nothing is built or run, so these run on any machine, the AVX2-only one included."""

from __future__ import annotations

import pytest
import torch

from app.backends.cpu import kernel_paths
from app.backends.cpu.decode_kernel_amx import amx_decode_status
from app.backends.cpu.kernel_paths import (
    AMX_TILES,
    BF16_DOT,
    FP32_FMA,
    decode_kernel_path,
    decode_unit,
)
from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from tests.backends.cpu._fake_cpu import (  # noqa: F401 - the fixture
    SAPPHIRE_RAPIDS,
    ZEN4,
    FakeCpu,
    fake_cpu,
)

BF16, F8, U8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8


@pytest.mark.parametrize(("q", "cache", "fmt", "amx", "dot", "unit"), [
    (BF16, BF16, "auto", True, True, AMX_TILES),
    (BF16, BF16, "auto", False, True, BF16_DOT),
    (BF16, BF16, "auto", False, False, FP32_FMA),
    (BF16, U8, "fp8_ds_mla", True, True, BF16_DOT),      # FP8 rows: never the tiles
    (BF16, U8, "fp8_ds_mla", True, False, FP32_FMA),
    (BF16, F8, "fp8_e4m3", True, True, BF16_DOT),
    (BF16, F8, "auto", True, True, BF16_DOT),            # a float8 tensor is an FP8 cache
    (torch.float16, F8, "fp8_e4m3", True, True, FP32_FMA),
    (torch.float32, torch.float32, "auto", True, True, FP32_FMA),
    (torch.float16, torch.float16, "auto", True, True, FP32_FMA),
])
def test_the_rule(q: torch.dtype, cache: torch.dtype, fmt: str, amx: bool, dot: bool,
                  unit: str) -> None:
    assert decode_unit(q, cache, fmt, amx=amx, bf16_dot=dot) == unit


def _backend(kv_cache_dtype: torch.dtype | str) -> CpuMLADecodeBackend:
    return CpuMLADecodeBackend(16, 0.05, 512, 64, kv_cache_dtype)


def _chosen(fake: FakeCpu, model: torch.dtype, cache: str) -> str:
    """The unit the backend's first step picks (its kernel and bf16_dot flag)."""
    be = _backend(model if cache == "auto" else cache)
    storage = {"auto": model, "fp8_e4m3": F8, "fp8_ds_mla": U8}[cache]
    kernel, dot = be._kernel_and_dot(model, storage)
    if kernel is fake.amx_kernel:
        assert not dot
        return AMX_TILES
    assert kernel is fake.kernel
    return BF16_DOT if dot else FP32_FMA


_PHRASE = {AMX_TILES: "AMX-BF16 tiles", BF16_DOT: "AVX512-BF16 dot products",
           FP32_FMA: "float32 FMAs"}


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ZEN4], ids=["amx", "zen4"])
@pytest.mark.parametrize("dot_switch", ["1", "0"])
def test_the_report_says_what_the_backend_picks(fake_cpu: FakeCpu,  # noqa: F811
                                                monkeypatch: pytest.MonkeyPatch, flags: str,
                                                dot_switch: str) -> None:
    fake_cpu.flags(flags)
    fake_cpu.decode_kernels()
    monkeypatch.setenv("APP_CPU_DECODE_BF16_DOT", dot_switch)
    for model in (BF16, torch.float16, torch.float32):
        for cache in ("auto", "fp8_e4m3", "fp8_ds_mla"):
            unit = _chosen(fake_cpu, model, cache)
            path = CpuMLADecodeBackend.kernel_path(model, cache)
            assert path.startswith(_PHRASE[unit]), (model, cache, unit, path)
    amx = flags == SAPPHIRE_RAPIDS and dot_switch == "1"
    assert _chosen(fake_cpu, BF16, "auto") == (AMX_TILES if amx else
                                               BF16_DOT if dot_switch == "1" else FP32_FMA)


def test_an_fp8_cache_on_an_amx_cpu_is_reported_on_the_dot_products(
        fake_cpu: FakeCpu) -> None:  # noqa: F811
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.decode_kernels()
    assert decode_kernel_path(BF16).startswith("AMX-BF16 tiles (self-test passed")
    for name in ("fp8_ds_mla", "fp8", "fp8_e4m3"):
        path = decode_kernel_path(BF16, name)
        assert path.startswith("AVX512-BF16 dot products (vdpbf16ps, float32 sums) on bf16 "
                               "tiles dequantised from the "), path
        assert "AMX not used (the AMX kernel reads bf16 caches only)" in path
    assert decode_kernel_path(torch.float16, "fp8_ds_mla").startswith(
        "float32 FMAs (AVX-512F) on float32 tiles dequantised from the fp8_ds_mla rows: "
        "float16 q")
    with pytest.raises(ValueError, match="unknown cache dtype 'fp9'"):
        decode_kernel_path(BF16, "fp9")


def test_bf16_dot_0_turns_the_amx_kernel_off_too(fake_cpu: FakeCpu,  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.decode_kernels()
    assert amx_decode_status().available
    monkeypatch.setenv("APP_CPU_DECODE_BF16_DOT", "0")
    status = amx_decode_status()
    assert not status.available and status.amx_cpu
    assert status.reason == ("turned off by APP_CPU_DECODE_BF16_DOT=0 (bf16 decode kept on "
                             "float32 FMAs)")
    assert decode_kernel_path(BF16) == (
        "float32 FMAs (AVX-512F): bf16 dot products turned off by APP_CPU_DECODE_BF16_DOT=0: "
        "AMX present but not used: turned off by APP_CPU_DECODE_BF16_DOT=0 (bf16 decode "
        "kept on float32 FMAs)")
    monkeypatch.setenv("APP_CPU_DECODE_BF16_DOT", "maybe")
    with pytest.raises(ValueError, match="APP_CPU_DECODE_BF16_DOT: expected one of"):
        amx_decode_status()


def test_amx_0_keeps_the_dot_products(fake_cpu: FakeCpu,  # noqa: F811
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.decode_kernels()
    monkeypatch.setenv("APP_CPU_AMX", "0")
    assert _chosen(fake_cpu, BF16, "auto") == BF16_DOT
    assert decode_kernel_path(BF16) == (
        "AVX512-BF16 dot products (vdpbf16ps, float32 sums): AMX present but not used: "
        "turned off by APP_CPU_AMX=0")


def test_a_backend_keeps_its_first_choice_per_kind_of_step(fake_cpu: FakeCpu,  # noqa: F811
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.decode_kernels()
    be = _backend(BF16)
    assert be._kernel_and_dot(BF16, BF16) == (fake_cpu.amx_kernel, False)
    monkeypatch.setenv("APP_CPU_DECODE_BF16_DOT", "0")
    assert be._kernel_and_dot(BF16, BF16) == (fake_cpu.amx_kernel, False)   # kept
    assert be._kernel_and_dot(torch.float32, torch.float32) == (fake_cpu.kernel, False)
    assert _backend(BF16)._kernel_and_dot(BF16, BF16) == (fake_cpu.kernel, False)


def test_without_the_kernel_the_report_says_why(fake_cpu: FakeCpu) -> None:  # noqa: F811
    fake_cpu.flags(ZEN4)
    fake_cpu.decode_kernels(avx512=False)
    assert kernel_paths.decode_kernel_path(BF16, "fp8_ds_mla") == (
        "none: native CPU decode kernel unavailable: no AVX-512 (faked)")
    with pytest.raises(ValueError, match="native CPU decode kernel unavailable"):
        _backend(BF16)._kernel_and_dot(BF16, BF16)
