"""CPU_MLA's AMX path: ``csrc/mla_decode_amx.c``, bf16 caches with a bf16 q on AMX-BF16 tiles.

The library has the AVX-512 decode kernel's interface (its argument struct and exported
functions, ``csrc/mla_decode_cpu.h``), so :class:`~app.backends.cpu.decode_kernel.
NativeMLADecodeKernel` runs it; CPU_MLA sends it the bf16 steps (bf16 cache and q) where it
loads, and everything else to the AVX-512 kernel, which every CPU without AMX keeps. How it
tiles MLA: the C source's header and ``docs/cpu-decode-kernel.md``.

Nothing here runs an AMX instruction before all of these hold (:func:`amx_decode_status`):
the CPU has ``amx_tile`` and ``amx_bf16``, neither ``APP_CPU_AMX`` nor
``APP_CPU_DECODE_BF16_DOT`` (which keeps bf16 on float32 FMAs) turns it off, Linux granted
this process the tile state (:mod:`app.backends.cpu.amx`), the library builds (``-mamx-tile
-mamx-bf16``: GCC >= 11 or clang >= 12) and its float64 self-test passes, first in a child
process (a kernel that was never run may crash rather than be wrong; the verdict is kept
beside the library: :mod:`app.backends.cpu.child_verdict`), then in this one. Otherwise CPU_MLA
runs bf16 on the AVX512-BF16 dot products, and ``python -m app platform`` and the selector's
explanation say why.

``SPEC_AMX_EMULATED`` is the same source with the tiles emulated in C (``csrc/amx_tiles.h``):
it runs on any AVX-512 CPU and is what the test suite checks against float64 (the tiles'
layouts and index arithmetic), with a count of every tile operation the hardware would refuse.
"""

from __future__ import annotations

import ctypes
import threading

import attrs
import torch

from app.backends.cpu.amx import AMX_ENV, amx_status, cpu_has_amx
from app.backends.cpu.decode_kernel import (
    ABI_VERSION,
    BF16_DOT_ENV,
    MlaDecodeArgs,
    NativeMLADecodeKernel,
    _openmp_requirements,
    _reference,
    plan_decode,
)
from app.backends.cpu.loader import (
    NativeLibrary,
    NativeLibrarySpec,
    NativeLibraryStatus,
    cpu_flags,
    load_native_library,
    read_switch,
)
from app.backends.cpu.openmp import LIBGOMP, OPENMP_ENV, runtime_function_address, torch_libgomp
from app.backends.cpu.prefill_kernel import SWITCH_ENV, _requirements

__all__ = ["SPEC_AMX", "SPEC_AMX_EMULATED", "SPEC_AMX_OPENMP", "AmxDecodeStatus",
           "amx_decode_status", "load_amx_decode_kernel", "load_emulated_amx_decode_kernel"]

_MODULE = "app.backends.cpu.decode_kernel_amx"
#: The AVX-512 flags the AMX source's softmax and packing use (every AMX CPU has them).
_AVX512 = ("avx512f", "avx512bw", "avx512vl")
_BASE_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c")


def _avx512_requirements() -> list[str]:
    reasons = _requirements()
    missing = [f for f in _AVX512 if f not in cpu_flags()]
    if missing and not reasons:
        reasons.append(f"needs {', '.join(missing)} (for the AMX source's AVX-512 parts)")
    return reasons


def _amx_requirements() -> list[str]:
    """Why the AMX build cannot run here: the AVX-512 kernel's reasons, AVX512BW, and the AMX
    tiles themselves (the CPU, ``APP_CPU_AMX``, Linux's permission, asked here)."""
    reasons = _avx512_requirements()
    if not reasons:
        status = amx_status()
        if not status.available:
            reasons.append(status.reason)
    return reasons


def _amx_openmp_requirements() -> list[str]:
    reasons = _amx_requirements()
    return reasons or _openmp_requirements()


def _faults(library: NativeLibrary) -> int:
    return int(library.function("mla_decode_amx_faults", ctypes.c_int64)())


def _cases() -> list[tuple[int, int, int, int, int, list[int], int]]:
    """(rank, rope, heads, qlen, block size, seq_lens, shares) of the self-test: staged key
    tiles (block 5), tiles read from the cache (block 64), a partial row group, causal
    steps, requests split into partial results, DeepSeek's 512 + 64."""
    return [(64, 32, 3, 2, 5, [2, 37, 700], 2),
            (512, 64, 16, 1, 64, [100, 300], 2),
            (512, 64, 20, 4, 16, [70, 600], 3)]


def _self_test(library: NativeLibrary) -> str | None:
    """bf16 caches on the tiles against float64 (outputs bf16 and float32, whole and split
    requests); with the emulated build, also no tile operation the hardware would refuse."""
    kernel = NativeMLADecodeKernel(library)
    gen = torch.Generator().manual_seed(0)
    for rank, rope, heads, qlen, bs, seq_lens, workers in _cases():
        blocks = [-(-n // bs) for n in seq_lens]
        table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
        start = 0
        for b, count in enumerate(blocks):
            table[b, :count] = perm[start:start + count]
            start += count
        cache = torch.randn(sum(blocks), bs, rank + rope, generator=gen).bfloat16()
        q = torch.randn(len(seq_lens), qlen, heads, rank + rope, generator=gen).bfloat16()
        for out_dtype, min_keys in ((torch.bfloat16, 512), (torch.float32, 64)):
            plan = plan_decode(seq_lens, workers, min_keys)
            out = torch.empty(len(seq_lens), qlen, heads, rank, dtype=out_dtype)
            lse = torch.empty(len(seq_lens), qlen, heads)
            kernel.run(plan, q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), rank,
                       out, lse, 0.1, 1.0)
            for b, n in enumerate(seq_lens):
                pos = torch.arange(n)
                latent = cache[table[b].long()[pos // bs], pos % bs].double()
                ref, ref_lse = _reference(q[b].double(), latent, rank, 0.1)
                err = max((out[b].double() - ref).abs().max().item(),
                          (lse[b].double() - ref_lse).abs().max().item())
                if not err < 3e-2:
                    return (f"self-test against float64 failed: max error {err:.3g} (rank "
                            f"{rank}, rope {rope}, {heads} heads, query_len {qlen}, block "
                            f"{bs}, request {b}, out {out_dtype}, {plan.parts} partials)")
    faults = _faults(library)
    if faults:
        return f"{faults} tile operations the hardware would refuse (#GP / #UD)"
    return None


def _openmp_self_test(library: NativeLibrary) -> str | None:
    """Bound to the ``libgomp.so.1`` torch runs on, then :func:`_self_test`."""
    if not library.function("mla_decode_cpu_openmp", ctypes.c_int32)():
        return "the compiler ignored -fopenmp"
    runtime, why = torch_libgomp()
    if runtime is None:
        return why
    ours = library.function("mla_decode_cpu_openmp_runtime", ctypes.c_void_p)()
    torchs = runtime_function_address(runtime, "omp_get_max_threads")
    if ours is None or ours != torchs:
        return f"bound to another OpenMP runtime than torch's {runtime}"
    return _self_test(library)


_STRUCTS = (("mla_decode_args", MlaDecodeArgs),)
_AMX_FLAGS = (*_BASE_FLAGS, "-mamx-tile", "-mamx-bf16")
#: The AMX build whose shares run on the package's pool.
SPEC_AMX = NativeLibrarySpec(
    name="mla_decode_amx", sources=("mla_decode_amx.c",), abi_version=ABI_VERSION,
    flags=_AMX_FLAGS, structs=_STRUCTS, self_test=_self_test, requirements=_amx_requirements,
    switches=(SWITCH_ENV, AMX_ENV), child_test=f"{_MODULE}:SPEC_AMX")
#: The AMX build whose shares run on torch's OpenMP team (as ``decode_kernel.SPEC_OPENMP``).
SPEC_AMX_OPENMP = NativeLibrarySpec(
    name="mla_decode_amx_openmp", sources=SPEC_AMX.sources, abi_version=ABI_VERSION,
    flags=(*_AMX_FLAGS, "-fopenmp"), link_flags=("-fopenmp", "-lm"), structs=_STRUCTS,
    self_test=_openmp_self_test, requirements=_amx_openmp_requirements,
    switches=(SWITCH_ENV, AMX_ENV, OPENMP_ENV), child_test=f"{_MODULE}:SPEC_AMX_OPENMP")
#: The same source with the tiles emulated in C: runs on any AVX-512 CPU (tests, ASan).
SPEC_AMX_EMULATED = NativeLibrarySpec(
    name="mla_decode_amx_emulated", sources=SPEC_AMX.sources, abi_version=ABI_VERSION,
    flags=(*_BASE_FLAGS, "-DAPP_AMX_EMULATE"), structs=_STRUCTS, self_test=_self_test,
    requirements=_avx512_requirements, switches=(SWITCH_ENV,),
    child_test=f"{_MODULE}:SPEC_AMX_EMULATED")


@attrs.frozen(eq=False)
class AmxDecodeStatus:
    """Whether CPU_MLA's AMX path runs here: ``library`` (the loaded build, or None),
    ``reason`` (why not, or what was loaded), ``shares`` (on which threads), ``amx_cpu``
    (the CPU reports AMX tiles, whether or not they can be used), ``notes`` (the loader's, of
    the builds it tried: a refused cache directory, an ignored verdict file)."""

    library: NativeLibrary | None
    reason: str
    shares: str = ""
    amx_cpu: bool = False
    notes: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        """The AMX build loaded and passed its self-tests."""
        return self.library is not None


def amx_decode_status() -> AmxDecodeStatus:
    """The AMX build CPU_MLA runs bf16 on (the OpenMP build where it loads, else the pool
    build), or why none does (``APP_CPU_AMX=0`` or ``APP_CPU_DECODE_BF16_DOT=0``: none).
    Builds and self-tests (in a child process, first) on first use on an AMX CPU; elsewhere
    it only reads the flags."""
    amx_cpu = cpu_has_amx()
    tiles = amx_status()
    if not tiles.available:
        return AmxDecodeStatus(None, tiles.reason, amx_cpu=amx_cpu)
    if not read_switch(BF16_DOT_ENV):  # the tiles multiply bf16 too: the switch keeps float32
        return AmxDecodeStatus(None, f"turned off by {BF16_DOT_ENV}=0 (bf16 decode kept on "
                                     f"float32 FMAs)", amx_cpu=amx_cpu)
    openmp = load_native_library(SPEC_AMX_OPENMP)
    if openmp.available:
        return AmxDecodeStatus(openmp.library, f"self-test passed ({openmp.path})",
                               f"on torch's OpenMP threads ({LIBGOMP})", amx_cpu, openmp.notes)
    pool: NativeLibraryStatus = load_native_library(SPEC_AMX)
    notes = tuple(dict.fromkeys((*openmp.notes, *pool.notes)))
    if pool.available:
        return AmxDecodeStatus(pool.library, f"self-test passed ({pool.path})",
                               "on the package's thread pool (OpenMP build unavailable: "
                               f"{'; '.join(openmp.reasons)})", amx_cpu, notes)
    return AmxDecodeStatus(None, "the AMX kernel is unusable: " + "; ".join(pool.reasons),
                           amx_cpu=amx_cpu, notes=notes)


_kernel_lock = threading.Lock()
_kernels: dict[str, tuple[NativeLibrary, NativeMLADecodeKernel]] = {}


def _kernel_of(library: NativeLibrary | None) -> NativeMLADecodeKernel | None:
    if library is None:
        return None
    with _kernel_lock:
        found = _kernels.get(library.spec.name)
        if found is None or found[0] is not library:
            found = _kernels[library.spec.name] = (library, NativeMLADecodeKernel(library))
        return found[1]


def load_amx_decode_kernel() -> NativeMLADecodeKernel | None:
    """The AMX decode kernel, or None where it cannot run (:func:`amx_decode_status`)."""
    return _kernel_of(amx_decode_status().library)


def load_emulated_amx_decode_kernel() -> NativeMLADecodeKernel | None:
    """The AMX source with emulated tiles (slow; for tests on any AVX-512 CPU), or None where
    it cannot be built (``load_native_library(SPEC_AMX_EMULATED).reasons`` says why)."""
    return _kernel_of(load_native_library(SPEC_AMX_EMULATED).library)
