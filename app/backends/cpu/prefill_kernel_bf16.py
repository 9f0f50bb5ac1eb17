"""The native CPU MLA prefill kernel with bf16 products, for bf16 inputs on AVX512-BF16 CPUs.

The same source as :mod:`app.backends.cpu.prefill_kernel` (``csrc/mla_prefill_cpu.c``), built a
second time with ``-DMLA_PREFILL_BF16 -mavx512bf16``: bf16 q/k/v then take the tiles of
``csrc/mla_prefill_cpu_bf16.h``, where q.k and p.v run through ``vdpbf16ps`` (pairs of
bf16 products accumulated in float32; the probabilities are rounded to bf16 before p.v, as
GPU kernels do), while the online softmax, the masking and the LSE stay the float32 code of
the shared source. float32 / float16 inputs in this library take the float32 path as before.

It is built and checked by the shared loader (ABI version, the ``mla_prefill_args`` layout)
and self-tested against a float64 reference at load, within bf16 tolerance. It is used only
where the CPU has AVX512-BF16 (:func:`app.platforms.detect_cpu_features`), the compiler knows
``-mavx512bf16`` and ``APP_CPU_BF16_KERNEL`` is not ``0``. Anything else (including a failed
self-test) leaves bf16 inputs on the float32 kernel, and :func:`native_bf16_kernel_status`
says why (``python -m app platform``, ``bench prefill``).
"""

from __future__ import annotations

import os
import threading

import torch

from app._cpu import detect_cpu_features
from app.backends.cpu.loader import (
    NativeLibrary,
    NativeLibrarySpec,
    load_native_library,
    read_switch,
    reset_native_libraries,
)
from app.backends.cpu.prefill_kernel import (
    ABI_VERSION,
    SPEC,
    MlaPrefillArgs,
    NativeKernelStatus,
    NativeMLAPrefillKernel,
)

__all__ = ["BF16_SWITCH_ENV", "SPEC_BF16", "load_native_bf16_kernel",
           "native_bf16_kernel_status"]

#: Set to ``0`` (or false/off/no) to keep bf16 inputs on the float32 kernel.
BF16_SWITCH_ENV = "APP_CPU_BF16_KERNEL"
#: Largest errors the self-test accepts against float64 on bf16-rounded inputs: the output
#: carries the bf16 rounding of the probabilities (2^-9 relative) and of the output itself;
#: the LSE only float32 sums of exact bf16 products.
SELF_TEST_OUT_TOLERANCE = 2e-2
SELF_TEST_LSE_TOLERANCE = 1e-3


def _requirements() -> list[str]:
    reasons = list(SPEC.requirements()) if SPEC.requirements is not None else []
    if not read_switch(BF16_SWITCH_ENV):
        reasons.append(f"turned off by {BF16_SWITCH_ENV}={os.environ.get(BF16_SWITCH_ENV)}")
    if not detect_cpu_features().avx512_bf16:
        reasons.append("needs a CPU with AVX512-BF16 (avx512_bf16), this one has none")
    return reasons


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int, kv_len: int,
               scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of one request, ``[T, H, *]`` in -> out ``[T, H, Dv]``, LSE
    ``[H, T]``."""
    qb, kb, vb = (x.double().transpose(0, 1) for x in (q, k, v))
    s = (qb @ kb.transpose(1, 2)) * scale
    if causal:
        hidden = torch.ones(q_len, kv_len, dtype=torch.bool).triu(kv_len - q_len + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return (torch.softmax(s, -1) @ vb).transpose(0, 1), torch.logsumexp(s, -1)


def _self_test(library: NativeLibrary) -> str | None:
    """bf16 inputs with an odd head dim and odd key counts (the pair padding) against float64
    on the same bf16 values: causal with float32 and bf16 outputs, and non-causal (every query
    block sees every key; the third request spans two query blocks). The error text if it
    disagrees."""
    kernel = NativeMLAPrefillKernel(library)
    gen = torch.Generator().manual_seed(0)
    q_lens, kv_lens = (37, 5, 131), (37, 9, 131)
    q_starts, kv_starts = [0, 37, 42], [0, 37, 46]
    heads, d, dv, scale = 3, 81, 64, 0.1
    q = torch.randn(sum(q_lens), heads, d, generator=gen).bfloat16()
    k = torch.randn(sum(kv_lens), heads, d, generator=gen).bfloat16()
    v = torch.randn(sum(kv_lens), heads, dv, generator=gen).bfloat16()
    out = torch.empty(q.shape[0], heads, dv)
    out16 = torch.empty(q.shape[0], heads, dv, dtype=torch.bfloat16)
    lse = torch.empty(heads, q.shape[0])
    kernel.attend(q, k, v, q_starts, q_lens, kv_starts, kv_lens, True, scale, out, lse)
    kernel.attend(q, k, v, q_starts, q_lens, kv_starts, kv_lens, True, scale, out16,
                  torch.empty(heads, q.shape[0]))
    full, full_lse = torch.empty_like(out), torch.empty_like(lse)
    kernel.attend(q, k, v, q_starts, q_lens, kv_starts, kv_lens, False, scale, full, full_lse)
    for b in range(3):
        qs, ks = q_starts[b], kv_starts[b]
        rows, keys = slice(qs, qs + q_lens[b]), slice(ks, ks + kv_lens[b])
        for causal, outs, got_lse in ((True, (out, out16), lse), (False, (full,), full_lse)):
            ref, ref_lse = _reference(q[rows], k[keys], v[keys], q_lens[b], kv_lens[b], scale,
                                      causal)
            err = max((o[rows].double() - ref).abs().max().item() for o in outs)
            err_lse = (got_lse[:, rows].double() - ref_lse).abs().max().item()
            if not (err < SELF_TEST_OUT_TOLERANCE and err_lse < SELF_TEST_LSE_TOLERANCE):
                return (f"bf16 self-test against float64 failed: max error {err:.3g} (output),"
                        f" {err_lse:.3g} (LSE) in request {b} (causal={causal})")
    return None


#: The bf16-products build of the prefill kernel (same source, same ABI and struct).
SPEC_BF16 = NativeLibrarySpec(
    name="mla_prefill_cpu_bf16", sources=SPEC.sources, abi_version=ABI_VERSION,
    flags=(*SPEC.flags, "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-DMLA_PREFILL_BF16"),
    structs=(("mla_prefill_args", MlaPrefillArgs),), self_test=_self_test,
    requirements=_requirements, switches=(*SPEC.switches, BF16_SWITCH_ENV))

_kernel_lock = threading.Lock()
_kernel: list[tuple[NativeLibrary, NativeMLAPrefillKernel]] = []


def load_native_bf16_kernel() -> NativeMLAPrefillKernel | None:
    """The bf16-products kernel, built and self-tested on first use; None where it cannot run
    (:func:`native_bf16_kernel_status` says why). ``ValueError`` for an unrecognised
    ``$APP_CPU_BF16_KERNEL`` or ``$APP_CPU_NATIVE_KERNEL``."""
    library = load_native_library(SPEC_BF16).library
    if library is None:
        return None
    with _kernel_lock:
        if not _kernel or _kernel[0][0] is not library:
            _kernel[:] = [(library, NativeMLAPrefillKernel(library))]
        return _kernel[0][1]


def native_bf16_kernel_status() -> NativeKernelStatus:
    """Whether :func:`load_native_bf16_kernel` gives a kernel (building it if not yet tried)."""
    status = load_native_library(SPEC_BF16)
    return NativeKernelStatus(status.available, status.reasons, status.path, status.notes)


def _reset_for_tests() -> None:
    """Forget the loaded bf16 kernel, so the next call probes and builds again."""
    reset_native_libraries(SPEC_BF16.name)
    with _kernel_lock:
        _kernel.clear()
