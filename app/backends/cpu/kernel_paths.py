"""Which arithmetic unit CPU_MLA's native kernel multiplies on, and why: AMX-BF16 tiles,
AVX512-BF16 dot products or float32 FMAs.

One rule, :func:`decode_unit`, decides it from the step's q dtype, the cache (its tensor
dtype and layout: a bf16 cache, an FP8 one) and what this process may run (the AMX kernel
loaded, the bf16 dot products on). CPU_MLA calls it to pick its kernel and the
``bf16_dot`` flag at its first step; :func:`decode_kernel_path` calls it for the text the
selector's explanation (``kernel_path``), ``python -m app backends`` and ``python -m app
platform`` print, so the report and the call cannot disagree.

``APP_CPU_DECODE_BF16_DOT=0`` keeps bf16 on float32 FMAs: it turns the AVX512-BF16 dot
products off and the AMX kernel too (``decode_kernel_amx.amx_decode_status``); ``APP_CPU_AMX=0``
turns the AMX kernel off only.
"""

from __future__ import annotations

import torch

from app._cpu import detect_cpu_features
from app.backends.cpu.decode_kernel import BF16_DOT_ENV, decode_kernel_status, has_bf16_dot
from app.backends.cpu.decode_kernel_amx import AmxDecodeStatus, amx_decode_status
from app.kvcache.cache_dtypes import canonical_kv_cache_dtype

__all__ = ["AMX_TILES", "BF16_DOT", "FP32_FMA", "UNITS", "decode_kernel_path", "decode_unit",
           "tiles_may_run"]

#: The units :func:`decode_unit` names (the ``bench`` peaks use the same words).
AMX_TILES = "amx_tiles"
BF16_DOT = "bf16_dot"
FP32_FMA = "fp32_fma"
UNITS = (AMX_TILES, BF16_DOT, FP32_FMA)


def _fp8(cache_dtype: torch.dtype, kv_cache_format: str) -> bool:
    return kv_cache_format != "auto" or cache_dtype == torch.float8_e4m3fn


def tiles_may_run(q_dtype: torch.dtype, cache_dtype: torch.dtype,
                  kv_cache_format: str = "auto") -> bool:
    """Whether a step of this kind could go to the AMX kernel at all (a bf16 q with a bf16
    cache: the AMX kernel reads no other cache), so that the AMX kernel is looked up (and
    built) only for such steps."""
    return (q_dtype == cache_dtype == torch.bfloat16
            and not _fp8(cache_dtype, kv_cache_format))


def decode_unit(q_dtype: torch.dtype, cache_dtype: torch.dtype, kv_cache_format: str = "auto",
                *, amx: bool, bf16_dot: bool) -> str:
    """The unit a step runs on: :data:`AMX_TILES` (``amx``: the AMX kernel is loaded, and
    :func:`tiles_may_run`), :data:`BF16_DOT` (a bf16 q with a bf16 or FP8 cache, and
    ``bf16_dot``: the CPU's dot products are on, :func:`has_bf16_dot`) or :data:`FP32_FMA`.
    ``cache_dtype`` is the cache tensor's dtype (float8_e4m3fn, uint8 for ``fp8_ds_mla``),
    ``kv_cache_format`` its layout (``"auto"``, ``"fp8_e4m3"``, ``"fp8_ds_mla"``)."""
    if amx and tiles_may_run(q_dtype, cache_dtype, kv_cache_format):
        return AMX_TILES
    products = cache_dtype == torch.bfloat16 or _fp8(cache_dtype, kv_cache_format)
    if bf16_dot and q_dtype == torch.bfloat16 and products:
        return BF16_DOT
    return FP32_FMA


def _no_dot_why() -> str:
    if detect_cpu_features().avx512_bf16:
        return f"bf16 dot products turned off by {BF16_DOT_ENV}=0"
    return "this CPU has no AVX512-BF16"


def _bf16_cache_path(unit: str, amx: AmxDecodeStatus) -> str:
    """The text for a bf16 q with a bf16 cache (``amx``: the AMX kernel's status)."""
    if unit == AMX_TILES:
        return f"AMX-BF16 tiles ({amx.reason}; shares {amx.shares})"
    path = ("AVX512-BF16 dot products (vdpbf16ps, float32 sums)" if unit == BF16_DOT
            else f"float32 FMAs (AVX-512F): {_no_dot_why()}")
    if amx.amx_cpu:
        return f"{path}: AMX present but not used: {amx.reason}"
    return f"{path}; no AMX ({amx.reason})"


def _fp8_cache_path(unit: str, q_dtype: torch.dtype, kv_cache_format: str) -> str:
    """The text for an FP8 cache: its rows dequantised a chunk at a time into a bf16 tile
    (dot products) or a float32 one (FMAs); never the AMX kernel."""
    tiles = "" if not detect_cpu_features().amx_bf16 else \
        "; AMX not used (the AMX kernel reads bf16 caches only)"
    if unit == BF16_DOT:
        return (f"AVX512-BF16 dot products (vdpbf16ps, float32 sums) on bf16 tiles "
                f"dequantised from the {kv_cache_format} rows{tiles}")
    why = (_no_dot_why() if q_dtype == torch.bfloat16
           else f"{str(q_dtype).removeprefix('torch.')} q")
    return (f"float32 FMAs (AVX-512F) on float32 tiles dequantised from the {kv_cache_format} "
            f"rows: {why}{tiles}")


def decode_kernel_path(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """The unit CPU_MLA's kernel multiplies on, and why, for a model of ``dtype`` (its q)
    with a cache of ``kv_cache_dtype`` (a cache dtype name: ``"auto"``, the model's dtype;
    ``"fp8"`` / ``"fp8_e4m3"``; ``"fp8_ds_mla"``), e.g. ``"AMX-BF16 tiles (self-test passed
    (...))"`` or ``"AVX512-BF16 dot products (vdpbf16ps, float32 sums): AMX present but not
    used: ..."``. Decided by :func:`decode_unit`, as CPU_MLA decides. Builds the kernels on
    first use (the AMX one only on a CPU with AMX, for a bf16 cache). ``ValueError`` for an
    unknown cache dtype name."""
    fmt = canonical_kv_cache_dtype(kv_cache_dtype)
    cache_dtype = {"auto": dtype, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_ds_mla": torch.uint8}[fmt]
    status, _ = decode_kernel_status()
    if not status.available:
        return "none: native CPU decode kernel unavailable: " + "; ".join(status.reasons)
    amx = amx_decode_status() if tiles_may_run(dtype, cache_dtype, fmt) else None
    unit = decode_unit(dtype, cache_dtype, fmt, amx=amx is not None and amx.available,
                       bf16_dot=has_bf16_dot())
    if fmt != "auto":
        return _fp8_cache_path(unit, dtype, fmt)
    if amx is not None:
        return _bf16_cache_path(unit, amx)
    if dtype == torch.float16:
        note = ("; AVX512-FP16 not used (fp16 products would round to fp16)"
                if detect_cpu_features().avx512_fp16 else "")
        return f"float32 FMAs (AVX-512F; fp16 converted to float32 as it loads){note}"
    if dtype == torch.float32:
        return "float32 FMAs (AVX-512F)"
    return f"float32 FMAs (AVX-512F; {str(dtype).removeprefix('torch.')} converted as it loads)"

