"""The latent cache dtypes (issue 36): the fp8_ds_mla row's byte layout, the writers' scale and
NaN/inf rules, the per-layer fp8 overflow count, the spec's page size and the config name."""

from __future__ import annotations

import struct

import pytest
import torch

from app.config import CacheConfig, EngineConfig
from app.kvcache.cache_dtypes import (
    FP8_E4M3_MAX,
    LatentCacheFormat,
    canonical_kv_cache_dtype,
    dequantize_fp8_ds_mla,
    dequantize_fp8_per_layer,
    ds_mla_row_bytes,
    ds_mla_scales,
    fp8_power_of_two_scale,
    quantize_fp8_ds_mla,
    quantize_fp8_per_layer,
)
from app.kvcache.specs import MLAAttentionSpec


def _latent(rows: int = 7, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 576, generator=gen) * torch.logspace(-3, 2, 576).roll(77)


def test_the_row_is_flashmla_s_656_bytes_in_its_order() -> None:
    """Bytes [0, 512) e4m3, [512, 528) four little-endian float32 scales, [528, 656) bf16
    rope: decoded by hand from the bytes, independently of the module's own reader."""
    latent = _latent(3)
    rows = quantize_fp8_ds_mla(latent, 512)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 656) == (3, ds_mla_row_bytes(512, 64))
    raw = bytes(rows[1].tolist())
    scales = struct.unpack("<4f", raw[512:528])
    nope = torch.frombuffer(bytearray(raw[:512]), dtype=torch.uint8).view(torch.float8_e4m3fn)
    rope = torch.frombuffer(bytearray(raw[528:]), dtype=torch.uint8).view(torch.bfloat16)
    by_hand = torch.cat([(nope.float().view(4, 128) * torch.tensor(scales).view(4, 1)).view(-1),
                         rope.float()])
    assert torch.equal(by_hand, dequantize_fp8_ds_mla(rows[1], 512, 64))
    assert torch.equal(rope.float(), latent[1, 512:].bfloat16().float())
    assert list(scales) == ds_mla_scales(rows[1], 512, 64).tolist()


def test_tile_scales_are_powers_of_two_over_finite_values_and_nothing_overflows() -> None:
    latent = _latent(16)
    rows = quantize_fp8_ds_mla(latent, 512)
    scales = ds_mla_scales(rows, 512, 64)
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())                                 # powers of two
    amax = latent[:, :512].abs().view(16, 4, 128).amax(-1)
    assert bool((amax / scales <= FP8_E4M3_MAX).all()) and bool((amax / scales > 224).all())
    back = dequantize_fp8_ds_mla(rows, 512, 64)
    rel = ((back[:, :512] - latent[:, :512]).abs() / latent[:, :512].abs()).view(16, 4, 128)
    normal = latent[:, :512].abs().view(16, 4, 128) >= scales.unsqueeze(-1) * 2**-6
    assert float(rel[normal].max()) <= 2**-4                 # e4m3's relative precision
    # the dequantised values are exact in bf16 (a power-of-two scale)
    assert torch.equal(back, back.bfloat16().float())


def test_a_non_finite_latent_value_stays_non_finite_and_spares_its_tile() -> None:
    latent = _latent(4)
    latent[0, 3] = float("inf")
    latent[1, 200] = float("-inf")
    latent[2, 300] = float("nan")
    latent[3, 520] = float("inf")                                         # rope: bf16 keeps it
    back = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(latent, 512), 512, 64)
    assert back[0, 3].isnan() and back[1, 200].isnan() and back[2, 300].isnan()
    assert back[3, 520] == float("inf")
    clean = _latent(4)
    clean_back = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(clean, 512), 512, 64)
    keep = torch.isfinite(latent)
    keep[3, 520] = False
    assert torch.equal(back[keep], clean_back[keep])    # the other values are untouched


def test_an_all_zero_tile_gets_vllm_s_floor() -> None:
    latent = _latent(1)
    latent[0, :128] = 0
    scales = ds_mla_scales(quantize_fp8_ds_mla(latent, 512), 512, 64)
    assert float(scales[0, 0]) == 2.0**-126
    assert fp8_power_of_two_scale(torch.tensor([448.0, 449.0, 0.0])).tolist() == [
        1.0, 2.0, 2.0**-126]


def test_a_reader_takes_any_scale_vllm_s_amax_over_448_included() -> None:
    """vLLM writes scale = amax / 448 (not a power of two): the reader must not assume one."""
    latent = _latent(2)
    nope = latent[:, :512].view(2, 4, 128)
    scales = (nope.abs().amax(-1) / 448).clamp_min(torch.finfo(torch.float32).tiny)
    q8 = (nope / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(2, 512)
    rows = torch.cat([q8.view(torch.uint8), scales.view(torch.uint8).view(2, 16),
                      latent[:, 512:].bfloat16().view(torch.uint8)], -1)
    back = dequantize_fp8_ds_mla(rows, 512, 64)
    want = (q8.float().view(2, 4, 128) * scales.unsqueeze(-1)).view(2, 512)
    assert torch.equal(back[:, :512], want)


def test_per_layer_fp8_saturates_counts_and_keeps_nan() -> None:
    latent = torch.tensor([[1.0, -2.0, 500.0, -1000.0, float("inf"), float("nan")]])
    q8, overflow = quantize_fp8_per_layer(latent, 1.0)
    assert int(overflow) == 2                     # 500 and -1000: saturated to +-448
    back = dequantize_fp8_per_layer(q8, 1.0)
    assert back[0, :4].tolist() == [1.0, -2.0, 448.0, -448.0]
    assert back[0, 4].isnan() and back[0, 5].isnan()   # torch's cast would give 448 for inf
    q8, overflow = quantize_fp8_per_layer(latent[:, :4], 4.0)
    assert int(overflow) == 0 and dequantize_fp8_per_layer(q8, 4.0)[0, 3] == -1024.0


def test_format_sizes_and_round_trip() -> None:
    latent = _latent(5).bfloat16()
    for name, width, nbytes in (("auto", 576, 1152), ("fp8", 576, 576),
                                ("fp8_e4m3", 576, 576), ("fp8_ds_mla", 656, 656)):
        fmt = LatentCacheFormat.from_name(name, torch.bfloat16, 512, 64)
        assert (fmt.row_width, fmt.bytes_per_token) == (width, nbytes)
        rows, _ = fmt.encode(latent, 0.5)
        assert rows.dtype == fmt.storage_dtype and rows.shape[-1] == width
        back = fmt.decode(rows, 0.5)
        assert back.dtype == torch.bfloat16 and back.shape == latent.shape
        if name == "auto":
            assert torch.equal(back, latent)
    assert canonical_kv_cache_dtype("FP8") == "fp8_e4m3"


@pytest.mark.parametrize("bad", [(500, 64), (0, 64), (512, -1)])
def test_ds_mla_refuses_dims_it_cannot_hold(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        ds_mla_row_bytes(*bad)


def test_the_spec_pages_follow_the_cache_dtype() -> None:
    sizes = {name: MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=512,
                                              qk_rope_head_dim=64, dtype="bfloat16",
                                              kv_cache_dtype=name).bytes_per_token
             for name in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")}
    assert sizes == {"auto": 1152, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}
    spec = MLAAttentionSpec(block_size=16, head_size=576, dtype="uint8",
                            cache_dtype_str="fp8_ds_mla")
    assert spec.page_size_bytes == 16 * 656              # vLLM's spec, rope 64 assumed
    with pytest.raises(ValueError, match="cache dtype"):
        MLAAttentionSpec(block_size=16, head_size=576, dtype="uint8", cache_dtype_str="int4")


def test_the_config_names_the_cache_dtype() -> None:
    assert CacheConfig().kv_cache_dtype == "auto"
    config = EngineConfig.from_dict({"cache": {"kv_cache_dtype": " FP8_DS_MLA "}})
    assert config.cache.kv_cache_dtype == "fp8_ds_mla"
    assert EngineConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"CacheConfig\.kv_cache_dtype.*allowed: auto, fp8"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(TypeError, match=r"CacheConfig\.kv_cache_dtype"):
        CacheConfig(kv_cache_dtype=8)  # type: ignore[arg-type]
