"""``bench decode --kv-cache-dtype fp8_ds_mla`` (or ``fp8``): decode over an FP8 latent cache,
each row timed beside the same backend over the model-dtype cache of the same requests.

For every case and every backend that reads the cache dtype (``supports_kv_cache_dtype``),
one float32 latent is made (``make_step``'s seeded one), and from it the model-dtype cache
(bf16 by default) and the FP8 cache: ``fp8_ds_mla`` rows as the engine writes them
(``app.kvcache.cache_dtypes``: a power-of-two scale per 128 values, the rope in bf16) or
e4m3 with one power-of-two scale for the whole cache (``fp8``). The same backend class runs
both, interleaved round by round with the peak and stream probes (a slow spell of a shared
machine hits them alike). The row is the FP8 call's, its cache bytes the FP8 rows' (656 per
token at 512 + 64, 576 for ``fp8``), and it carries ``bf16_cache_ms`` and
``speedup_vs_bf16_cache`` (the model dtype's cache over the FP8 one, best call over best
call; ``speedup_vs_bf16_cache_paired``: the median over the rounds of each round's ratio).
With another model dtype (``--dtypes fp32``) the fields say ``model_cache`` instead.

Targets (issue 36; CPU_MLA, bf16, full-size cases): ``16x8k`` and ``64x4k`` at >= 1.6x the
bf16 cache (the byte ratio is 1152 / 656 = 1.76), ``16x8k h128`` and ``64x4k q4`` no slower
(>= 1.0x). On a CPU where the 16-head cases are bound by the bf16 dot products rather than by
memory (the project's 2-core EPYC when quiet: ``docs/cpu-decode-kernel.md``) the first two
cannot be met by fewer bytes alone: the products are the same, and the FP8 rows cost a
conversion per chunk.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from app.backends.decode.base import MLADecodeBackend
from app.bench._decode_cases import RANK, ROPE, Case, make_step
from app.bench._timing import time_interleaved
from app.kvcache.cache_dtypes import (
    LatentCacheFormat,
    canonical_kv_cache_dtype,
    fp8_power_of_two_scale,
    quantize_fp8_ds_mla,
    quantize_fp8_per_layer,
)

__all__ = ["FP8_SPEEDUP_TARGETS", "fp8_cache", "fp8_targets", "run_fp8_case"]

#: Case -> the least ``speedup_vs_bf16_cache`` of CPU_MLA on a bf16 model (issue 36).
FP8_SPEEDUP_TARGETS = {"16x8k": 1.6, "64x4k": 1.6, "16x8k h128": 1.0, "64x4k q4": 1.0}


def fp8_cache(latent: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, float]:
    """``(the FP8 cache of latent [blocks, block_size, 576], the k_scale to pass)``."""
    if canonical_kv_cache_dtype(kv_cache_dtype) == "fp8_ds_mla":
        return quantize_fp8_ds_mla(latent, RANK), 1.0
    scale = float(fp8_power_of_two_scale(latent.abs().amax()))
    return quantize_fp8_per_layer(latent, scale)[0], scale


def run_fp8_case(cls: type[MLADecodeBackend], case: Case, dtype: torch.dtype, dtype_name: str,
                 kv_cache_dtype: str, block_size: int, device: torch.device, repeat: int,
                 make_backend: Callable[..., MLADecodeBackend],
                 probes: dict[str, Callable[[], None]], sync: Callable[[], None]
                 ) -> dict[str, Any]:
    """One row (see the module docstring). ``make_backend(cls, case, step, device,
    kv_cache_dtype)`` builds a prepared backend; ``probes``: the untimed functions run beside
    each round (their samples are the caller's)."""
    step = make_step(case, block_size, device, torch.float32)
    fp8, k_scale = fp8_cache(step.cache.cpu(), kv_cache_dtype)
    fp8 = fp8.to(device)
    model_cache, q = step.cache.to(dtype), step.q.to(dtype)
    name = canonical_kv_cache_dtype(kv_cache_dtype)
    fmt = LatentCacheFormat.from_name(name, dtype, RANK, ROPE)
    be_fp8 = make_backend(cls, case, step, device, "fp8" if name == "fp8_e4m3" else name)
    be_model = make_backend(cls, case, step, device, dtype)
    scale = None if name == "fp8_ds_mla" else k_scale
    fns: dict[str, Callable[[], object]] = {
        "fp8": lambda: be_fp8.run_decode(q, fp8, return_softmax_lse=True, k_scale=scale),
        "model": lambda: be_model.run_decode(q, model_cache, return_softmax_lse=True),
        **probes}
    timed = time_interleaved(fns, repeat=repeat, sync=sync)
    t, tm = min(timed["fp8"]), min(timed["model"])
    paired = statistics.median(m / f for m, f in zip(timed["model"], timed["fp8"], strict=True))
    cache_bytes = case.batch * case.context * fmt.bytes_per_token
    which = "bf16_cache" if dtype == torch.bfloat16 else "model_cache"
    return {
        "backend": cls.get_name(), "case": case.name, "dtype": dtype_name,
        "kv_cache_dtype": kv_cache_dtype, "bytes_per_token": fmt.bytes_per_token,
        "batch": case.batch, "context": case.context, "heads": case.heads,
        "query_len": case.query_len, "block_size": block_size,
        "gflop": round(case.flops() / 1e9, 3), "cache_mb": round(cache_bytes / 1e6, 1),
        "ms": round(t * 1e3, 3), "ms_median": round(statistics.median(timed["fp8"]) * 1e3, 3),
        "gflops": round(case.flops() / t / 1e9, 1), "cache_gbs": round(cache_bytes / t / 1e9, 2),
        f"{which}_ms": round(tm * 1e3, 3),
        f"{which}_ms_median": round(statistics.median(timed["model"]) * 1e3, 3),
        f"speedup_vs_{which}": round(tm / t, 3),
        f"speedup_vs_{which}_paired": round(paired, 3),
        "fp8_calls_s": timed["fp8"]}


def fp8_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets read off CPU_MLA's bf16 FP8 rows (``speedup_vs_bf16_cache``)."""
    targets = []
    for row in rows:
        want = FP8_SPEEDUP_TARGETS.get(row["case"])
        if row["backend"] != "CPU_MLA" or want is None or "speedup_vs_bf16_cache" not in row:
            continue
        value = row["speedup_vs_bf16_cache"]
        targets.append({"name": f"CPU_MLA {row['case']} {row['kv_cache_dtype']} speed-up over "
                                f"the bf16 cache", "measure": "speedup_vs_bf16_cache",
                        "paired": row.get("speedup_vs_bf16_cache_paired"), "value": value,
                        "target": want, "pass": value >= want})
    return targets
