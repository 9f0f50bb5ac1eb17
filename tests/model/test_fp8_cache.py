"""An FP8 latent cache in the model and the engine (issue 36): written once, quantised, read
back dequantised by the prefill path and the decode backends; the per-layer scale that
cannot clip; the engine against the dense model whose keys and values pass through the same
cache."""

from __future__ import annotations

import logging

import pytest
import torch

from app.config import AttentionConfig, CacheConfig, EngineConfig, ModelConfig
from app.containers import create_container
from app.kvcache.cache_dtypes import FP8_E4M3_MAX, dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from app.mla.engine import MLAEngine
from app.mla.requests import Request, RowKind
from app.model import (
    MLAAttention,
    PagedLatentCache,
    ReferenceModel,
    RotaryEmbedding,
    random_config,
    random_weights,
)
from app.model.attention import fp8_cache_scale, latent_bound

#: The smallest dims every FP8 layout holds: kv_lora_rank a multiple of 128 (fp8_ds_mla's
#: tiles), rope a multiple of 32 (CPU_MLA's kernel).
SMALL = {"num_heads": 2, "hidden_size": 64, "kv_lora_rank": 128, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 32, "v_head_dim": 16}
VOCAB = 61


def small_model(dtype: torch.dtype = torch.float32, layers: int = 1, seed: int = 0
                ) -> tuple[object, object]:
    arch = random_config(ModelConfig(dtype=dtype, **SMALL), num_layers=layers,
                         vocab_size=VOCAB)
    return arch, random_weights(arch, dtype, seed)


def small_engine(kv_cache_dtype: str, dtype: torch.dtype = torch.float32, layers: int = 1,
                 decode: str = "TORCH_SDPA", spec: int = 0, step_tokens: int = 256,
                 block_size: int = 4, keep_outputs: bool = True) -> MLAEngine:
    arch, weights = small_model(dtype, layers)
    config = EngineConfig(model=arch.model_config(dtype),  # type: ignore[attr-defined]
                          attention=AttentionConfig(mla_decode_backend=decode),
                          cache=CacheConfig(block_size=block_size, num_blocks=256,
                                            kv_cache_dtype=kv_cache_dtype))
    return MLAEngine(create_container(config), weights=weights,  # type: ignore[arg-type]
                     step_tokens=step_tokens, num_speculative_tokens=spec,
                     keep_outputs=keep_outputs)


def prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length + 5 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"])
def test_paged_cache_stores_the_format_and_gathers_the_model_dtype(name: str) -> None:
    cache = PagedLatentCache(8, 4, 160, torch.bfloat16, kv_cache_dtype=name, kv_lora_rank=128,
                             k_scale=0.5)
    width, nbytes = {"auto": (160, 320), "fp8": (160, 160), "fp8_e4m3": (160, 160),
                     "fp8_ds_mla": (128 + 4 + 64, 196)}[name]
    assert cache.data.shape == (8, 4, width) and cache.nbytes == 8 * 4 * nbytes
    latent = torch.randn(6, 160).bfloat16()
    slots = torch.tensor([3, 9, 10, 11, 20, 31])
    cache.write(slots, latent)
    back = cache.gather(slots)
    assert back.dtype == torch.bfloat16
    if name == "auto":
        assert torch.equal(back, latent)
    elif name == "fp8_ds_mla":
        want = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(latent, 128), 128, 32, torch.bfloat16)
        assert torch.equal(back, want)
        assert torch.equal(cache.data.view(-1, width)[slots], quantize_fp8_ds_mla(latent, 128))
    else:
        assert cache.k_scale == 0.5
        assert torch.equal(back, (latent.float() / 0.5).to(torch.float8_e4m3fn).float().mul(0.5)
                           .bfloat16())
    out = torch.empty(10, 160, dtype=torch.bfloat16)
    assert torch.equal(cache.gather(slots, out=out), back)
    assert torch.equal(cache.read_tokens([0, 5, 2, 7], 9, 12), cache.gather(
        torch.tensor([2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3])))


def test_ds_mla_needs_where_the_latent_ends() -> None:
    with pytest.raises(ValueError, match="needs kv_lora_rank"):
        PagedLatentCache(4, 4, 160, torch.bfloat16, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="k_scale"):
        PagedLatentCache(4, 4, 160, torch.bfloat16, kv_cache_dtype="fp8", k_scale=float("nan"))


def _layer(dtype: torch.dtype = torch.float32) -> tuple[object, object, MLAAttention]:
    arch, weights = small_model(dtype)
    rope = RotaryEmbedding(arch.rope, arch.qk_rope_head_dim, dtype,  # type: ignore[attr-defined]
                           torch.device("cpu"))
    layer = MLAAttention(arch, weights.layers[0].attention,  # type: ignore[attr-defined]
                         dtype=dtype, compute_dtype=dtype, device=torch.device("cpu"),
                         rope=rope)
    return arch, weights, layer


def test_the_per_layer_scale_holds_every_input_even_the_worst() -> None:
    """No input makes a latent value exceed 448 x the layer's scale: random inputs of any
    size, and the input that aligns the attention's input with a rope row of kv_a_proj
    (where Cauchy-Schwarz is tight), at every position."""
    arch, weights, layer = _layer()
    layer0 = weights.layers[0]  # type: ignore[attr-defined]
    norm = layer0.input_layernorm
    bound = latent_bound(layer0.attention, norm, 128, float(layer.rope.scale))
    scale = fp8_cache_scale(arch, layer0)  # type: ignore[arg-type]
    assert bound <= FP8_E4M3_MAX * scale < 2 * bound
    rope_rows = layer0.attention.kv_a_proj[128:]
    worst = rope_rows[rope_rows.norm(dim=1).argmax()]
    # h whose RMS-normalised value times the norm weight is parallel to that row
    h = torch.cat([(worst / norm * 1e3).expand(200, -1), torch.randn(300, 64) * 1e4])
    positions = torch.arange(h.shape[0]) * 37
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    _, latent = layer.project(x, positions, int(positions.max()))
    biggest = float(latent.abs().max())
    assert biggest <= FP8_E4M3_MAX * scale
    assert biggest >= bound / 4      # and the bound is not absurdly loose for the worst input


def test_a_scale_too_small_is_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    engine = small_engine("fp8")
    assert engine.pool_usage()["fp8_overflows"] == 0
    for cache in engine.model.caches:
        cache.k_scale = 1e-6          # someone else's scale, far too small
    engine.add_request(Request("r", prompts(1, 9)[0], max_new_tokens=2))
    with caplog.at_level(logging.WARNING, logger="app.model.model"):
        engine.run()
    assert engine.stats.fp8_overflows > 0
    assert "saturated" in caplog.text


def _decode_and_prefill_errors(kv_cache_dtype: str, spec: int = 0) -> tuple[float, float]:
    """The fp32 engine (TORCH_SDPA decode, one prefill chunk per prompt) against the dense
    fp32 model whose keys and values go through the same cache: decode rows read every key
    from the cache, so they must agree to float32 rounding; prefill rows attend over their
    own exact latents (as vLLM's prefill does), so they agree with the plain model."""
    engine = small_engine(kv_cache_dtype, spec=spec)
    for i, p in enumerate(prompts(3, 11)):
        engine.add_request(Request(f"r{i}", p, max_new_tokens=9))
    outputs = engine.run()
    quantised = ReferenceModel(engine.weights, torch.float32, kv_cache_dtype=kv_cache_dtype)
    plain = ReferenceModel(engine.weights, torch.float32)
    decode_err = prefill_err = 0.0
    for out in outputs:
        assert out.hidden is not None and out.row_kinds is not None
        rows = torch.arange(out.hidden.shape[0])
        decode = out.row_kinds == int(RowKind.DECODE)
        prefill = out.row_kinds == int(RowKind.PREFILL)     # (the last row was not computed)
        want_q = quantised.outputs(out.token_ids, rows).hidden
        want_p = plain.outputs(out.token_ids, rows).hidden
        decode_err = max(decode_err, float((out.hidden[decode] - want_q[decode]).abs().max()))
        prefill_err = max(prefill_err, float((out.hidden[prefill] - want_p[prefill]).abs().max()))
    return decode_err, prefill_err


@pytest.mark.parametrize("name", ["fp8", "fp8_ds_mla"])
def test_the_engine_reads_what_it_wrote(name: str) -> None:
    decode_err, prefill_err = _decode_and_prefill_errors(name)
    assert decode_err < 1e-4 and prefill_err < 1e-4


def test_speculative_tokens_are_written_and_read_through_the_cache() -> None:
    decode_err, _ = _decode_and_prefill_errors("fp8_ds_mla", spec=2)
    assert decode_err < 1e-4


def test_the_pool_holds_more_tokens_per_byte() -> None:
    auto, ds = small_engine("auto"), small_engine("fp8_ds_mla")
    assert auto.pool_usage()["bytes_per_token_per_layer"] == 160 * 4
    assert ds.pool_usage()["bytes_per_token_per_layer"] == 128 + 4 + 64
    assert ds.model.cache_bytes * 640 == auto.model.cache_bytes * 196
    spec = ds.kv_cache_groups[0].kv_cache_spec
    assert spec.cache_dtype_str == "fp8_ds_mla" and spec.page_size_bytes == 4 * 196
