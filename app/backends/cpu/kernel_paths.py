"""Which arithmetic unit CPU_MLA's native kernel multiplies on for a cache dtype here, and
why: AMX-BF16 tiles, AVX512-BF16 dot products or float32 FMAs. Read from the CPU's flags and
the kernels' own build and self-test status; the selector's explanation (``kernel_path``),
``python -m app backends`` and ``python -m app platform`` print it."""

from __future__ import annotations

import torch

from app._cpu import detect_cpu_features
from app.backends.cpu.decode_kernel import BF16_DOT_ENV, decode_kernel_status, has_bf16_dot
from app.backends.cpu.decode_kernel_amx import amx_decode_status

__all__ = ["decode_kernel_path"]


def _dot_or_fma(fallback_why: str) -> str:
    if has_bf16_dot():
        return "AVX512-BF16 dot products (vdpbf16ps, float32 sums)"
    if detect_cpu_features().avx512_bf16:
        return f"float32 FMAs (AVX-512F): bf16 dot products turned off by {BF16_DOT_ENV}=0"
    return f"float32 FMAs (AVX-512F): {fallback_why}"


def decode_kernel_path(dtype: torch.dtype) -> str:
    """The unit CPU_MLA's kernel multiplies a ``dtype`` cache (with a q of the same dtype) on,
    and why, e.g. ``"AMX-BF16 tiles (self-test passed (...))"`` or ``"AVX512-BF16 dot
    products (vdpbf16ps, float32 sums): AMX present but Linux refused ..."``. Builds the
    kernels on first use (the AMX one only on a CPU with AMX)."""
    status, _ = decode_kernel_status()
    if not status.available:
        return "none: native CPU decode kernel unavailable: " + "; ".join(status.reasons)
    if dtype == torch.bfloat16:
        amx = amx_decode_status()
        if amx.available:
            return f"AMX-BF16 tiles ({amx.reason}; shares {amx.shares})"
        path = _dot_or_fma("this CPU has no AVX512-BF16")
        if amx.amx_cpu:
            return f"{path}: AMX present but not used: {amx.reason}"
        return f"{path}; no AMX ({amx.reason})"
    if dtype == torch.float16:
        note = ("; AVX512-FP16 not used (fp16 products would round to fp16)"
                if detect_cpu_features().avx512_fp16 else "")
        return f"float32 FMAs (AVX-512F; fp16 converted to float32 as it loads){note}"
    if dtype == torch.float32:
        return "float32 FMAs (AVX-512F)"
    return f"float32 FMAs (AVX-512F; {str(dtype).removeprefix('torch.')} converted as it loads)"
