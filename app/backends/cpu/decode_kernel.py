"""The native CPU MLA decode kernel (``csrc/mla_decode_cpu.c``), which CPU_MLA runs.

The kernel reads the paged latent cache in place through the block table (no gather copy of
the context), loads each cache row once for all the query rows of its request (the latent
cache has one KV head: ``query_len * num_heads`` rows share it), accumulates in float32 and
writes the output and the natural-log LSE. On a CPU with AVX512-BF16, a bf16 cache with a
bf16 q runs on its bf16 dot products (bf16 products summed in float32, p rounded to bf16 for
p.v, as GPU kernels do): twice the multiply-adds per instruction of float32 FMAs
(``APP_CPU_DECODE_BF16_DOT=0`` keeps the float32 path, the AMX kernel's too). bf16 /
fp16 / fp32 caches, and the FP8 ones (``kv_cache_format``: float8_e4m3fn rows with the layer's
scale in ``k_scale``, or DeepSeek's ``fp8_ds_mla`` uint8 rows; each chunk of keys is
dequantised once into a per-thread tile, ``csrc/mla_decode_cpu_fp8.h``), any block size,
``query_len`` 1..16 (causal inside the step), ``kv_lora_rank`` a multiple of 64 and
``qk_rope_head_dim`` a multiple of 32 (DeepSeek: 512 and 64). vLLM's CPU decode kernel handles
only head size 576, block size 16 and returns no LSE.

Threads: the step's requests are dealt onto ``torch.get_num_threads()`` shares (costliest
first, each to the least-loaded share); a request longer than its fair share of the step's
keys is split into key ranges whose partial results are merged by LSE, so one long request
still uses every core. The shares run on the calling thread's OpenMP team, the threads torch's
own ops run on (awake and spinning right after the layer's projections), when the library is
built with ``-fopenmp`` bound to the ``libgomp.so.1`` torch loaded (``app.backends.cpu.openmp``
checks it); otherwise (another OpenMP runtime, a failed build, ``APP_CPU_DECODE_OPENMP=0``, a
forked child: see ``cpu.openmp``) on the package's own pool (``app.backends.cpu.pool``).
Memory per call: one scratch buffer per share (the packed query and accumulators of one
request: ``query_len * num_heads * (2 * kv_lora_rank + qk_rope_head_dim)`` floats; kept per
calling thread) and, for split requests, their partial outputs; nothing grows with the
context.

Built, cached and self-tested by ``app.backends.cpu.loader`` on first use;
``APP_CPU_NATIVE_KERNEL=0`` turns it off (as for the prefill kernel). Unavailable (no
AVX-512, no C compiler, switched off), it says why (``decode_kernel_status``).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable, Sequence

import attrs
import torch

from app.backends.cpu.loader import (
    NativeLibrary,
    NativeLibrarySpec,
    NativeLibraryStatus,
    cpu_flags,
    load_native_library,
    read_switch,
)
from app.backends.cpu.openmp import (
    LIBGOMP,
    OPENMP_ENV,
    runtime_function_address,
    same_process,
    torch_libgomp,
)
from app.backends.cpu.pool import run_shares
from app.backends.cpu.prefill_kernel import SWITCH_ENV, _requirements
from app.backends.cpu.scratch import thread_scratch
from app.kvcache.cache_dtypes import (
    dequantize_fp8_ds_mla,
    ds_mla_row_bytes,
    quantize_fp8_ds_mla,
)

__all__ = ["BF16_DOT_ENV", "SPEC", "SPEC_OPENMP", "DecodePlan", "MlaDecodeArgs",
           "NativeMLADecodeKernel", "decode_kernel_status", "has_bf16_dot", "load_decode_kernel",
           "plan_decode"]

#: Set to ``0`` to keep bf16 caches on the float32 FMA path (to compare the two): neither the
#: AVX512-BF16 dot products nor CPU_MLA's AMX kernel (``decode_kernel_amx``) run then.
BF16_DOT_ENV = "APP_CPU_DECODE_BF16_DOT"
#: ``MLA_DECODE_CPU_ABI`` in ``cpu/csrc/mla_decode_cpu.h``.
ABI_VERSION = 5
#: The most partial results the kernel merges per request (``MAX_PARTS`` in the C source).
MAX_PARTS = 64
#: The FP8 cache layouts the kernel reads (``csrc/mla_decode_cpu_fp8.h``).
FP8_FORMATS = ("fp8_e4m3", "fp8_ds_mla")
#: A request is split only into pieces of at least this many keys (a piece re-packs q).
MIN_KEYS_PER_PART = 512
_LOG2E = 1.0 / math.log(2.0)
_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float


class MlaDecodeArgs(ctypes.Structure):
    """``mla_decode_args`` of ``cpu/csrc/mla_decode_cpu.h`` (layout checked at load)."""

    _fields_ = [
        ("cache", _ptr), ("q", _ptr), ("out", _ptr), ("lse", _ptr), ("block_table", _ptr),
        ("seq_lens", _ptr), ("items", _ptr), ("merge", _ptr), ("part_out", _ptr),
        ("part_lse", _ptr), ("scratch", _ptr),
        ("batch", _i64), ("qlen", _i64), ("heads", _i64), ("rank", _i64), ("rope", _i64),
        ("num_blocks", _i64), ("block_size", _i64), ("block_stride", _i64),
        ("row_stride", _i64), ("bt_stride", _i64), ("q_sb", _i64), ("q_si", _i64),
        ("q_sh", _i64), ("n_items", _i64), ("n_merge", _i64), ("cache_dt", _i32),
        ("q_dt", _i32), ("out_dt", _i32), ("bf16_dot", _i32), ("q_mult", _f32),
        ("v_mult", _f32)]


@attrs.frozen(eq=False)
class DecodePlan:
    """A step's work split: ``shares`` one ``[n, 4]`` int64 array of (request, first key,
    end key, part) per worker (part -1: the whole request, written directly); ``merge``
    ``[m, 3]`` int64 (request, first part, parts) for the split requests; ``parts`` the
    number of partial results; ``items`` every share's rows back to back (``shares`` are
    views of it) and ``share_end`` int64 ``[len(shares)]`` where each share's rows end."""

    shares: tuple[torch.Tensor, ...]
    merge: torch.Tensor
    parts: int
    items: torch.Tensor
    share_end: torch.Tensor


def plan_decode(seq_lens: Sequence[int], workers: int,
                min_keys_per_part: int = MIN_KEYS_PER_PART) -> DecodePlan:
    """Deal the step's requests onto ``workers`` shares, splitting long ones (see module)."""
    total = sum(seq_lens)
    fair = max(1, -(-total // max(1, workers)))
    pieces: list[tuple[int, int, int, int]] = []
    merge: list[tuple[int, int, int]] = []
    parts = 0
    for b, n in enumerate(seq_lens):
        count = min(MAX_PARTS, max(1, min(n // max(1, min_keys_per_part), -(-n // fair))))
        if count == 1:
            pieces.append((b, 0, n, -1))
            continue
        merge.append((b, parts, count))
        for p in range(count):
            pieces.append((b, n * p // count, n * (p + 1) // count, parts + p))
        parts += count
    loads = [0] * max(1, min(workers, len(pieces)))
    dealt: list[list[tuple[int, int, int, int]]] = [[] for _ in loads]
    for piece in sorted(pieces, key=lambda x: x[2] - x[1], reverse=True):
        w = loads.index(min(loads))
        dealt[w].append(piece)
        loads[w] += piece[2] - piece[1] + 16      # + a request's fixed cost (packing q)
    sizes = [len(d) for d in dealt if d]
    items = torch.tensor([piece for d in dealt for piece in d], dtype=torch.int64).reshape(-1, 4)
    shares = tuple(torch.split(items, sizes)) if sizes else ()
    share_end = torch.tensor(sizes, dtype=torch.int64).cumsum(0) if sizes else \
        torch.zeros(0, dtype=torch.int64)
    return DecodePlan(shares, torch.tensor(merge, dtype=torch.int64).reshape(-1, 3), parts,
                      items, share_end)


#: Largest per-thread scratch buffer kept between calls.
SCRATCH_KEEP_BYTES = 256 << 20


def _scratch(floats: int) -> torch.Tensor:
    """This thread's scratch of at least ``floats`` float32s (``cpu.scratch``)."""
    return thread_scratch(floats, SCRATCH_KEEP_BYTES)


class NativeMLADecodeKernel:
    """The loaded decode kernel: :meth:`run` one step's decode on checked CPU tensors.
    ``openmp``: the library runs a call's shares on the calling thread's OpenMP team."""

    def __init__(self, library: NativeLibrary) -> None:
        self.library = library
        self._run = library.function("mla_decode_cpu_run", _i32, ctypes.POINTER(MlaDecodeArgs))
        self._run_shares = library.function(
            "mla_decode_cpu_run_shares", _i32, ctypes.POINTER(MlaDecodeArgs), _ptr, _i64, _i64,
            _i32)
        self.openmp = bool(library.function("mla_decode_cpu_openmp", _i32)())
        self._merge = library.function("mla_decode_cpu_merge", _i32,
                                       ctypes.POINTER(MlaDecodeArgs))
        self._scratch_floats = library.function("mla_decode_cpu_scratch_floats", _i64, _i64,
                                                _i64, _i64, _i64)
        cache_code = library.function("mla_decode_cpu_cache_code", _i32, ctypes.c_char_p)
        #: The FP8 cache layouts' codes (``mla_decode_cpu_fp8.h``).
        self.fp8_codes = {name: int(cache_code(name.encode())) for name in FP8_FORMATS}

    def run(self, plan: DecodePlan, q: torch.Tensor, kv_cache: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int,
            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
            k_scale: float, bf16_dot: bool | None = None, openmp: bool | None = None,
            kv_cache_format: str = "auto") -> None:
        """Decode every request of ``plan``: ``q [B, Q, H, D]`` (unit last stride),
        ``kv_cache [num_blocks, block_size, D]`` (unit last stride), ``block_table`` int32
        ``[B, W]`` and ``seq_lens`` int32 ``[B]`` (contiguous, already checked against the
        cache), ``out [B, Q, H, kv_lora_rank]`` contiguous in q's dtype, ``lse [B, Q, H]``
        float32 contiguous or None. All on the CPU. ``kv_cache_format``: ``"auto"`` (a bf16,
        fp16 or fp32 cache, or float8_e4m3fn: ``"fp8_e4m3"``, its scale in ``k_scale``) or
        ``"fp8_ds_mla"`` (uint8 rows of ``ds_mla_row_bytes``; ``app.kvcache.cache_dtypes``).
        ``bf16_dot`` (default: wherever it can: :func:`has_bf16_dot`; True asks for them
        whatever the switch says) runs a bf16 q with a bf16 or FP8 cache on the CPU's
        AVX512-BF16 dot products; ``openmp`` (default: wherever it can) runs the shares on
        this thread's OpenMP team rather than on the package's pool (never in a forked child:
        see ``cpu.openmp``)."""
        if openmp and not self.openmp:
            raise ValueError("native CPU decode kernel: openmp needs the library built with "
                             "OpenMP (see decode_kernel_status())")
        batch, qlen, heads, dim = q.shape
        cache_dt = self._cache_code(kv_cache, kv_cache_format, kv_lora_rank, dim)
        dot_ok = q.dtype == torch.bfloat16 and (kv_cache.dtype == torch.bfloat16
                                                 or cache_dt in self.fp8_codes.values())
        if bf16_dot is None:
            bf16_dot = dot_ok and has_bf16_dot()
        elif bf16_dot and not (dot_ok and _cpu_has_bf16_dot()):
            raise ValueError("native CPU decode kernel: bf16_dot needs a bf16 q with a bf16 or "
                             "FP8 cache on a CPU with AVX512-BF16 and AVX512BW")
        rows = qlen * heads
        codes = self.library.dtype_code
        part_out = torch.empty(plan.parts, rows, kv_lora_rank) if plan.parts else None
        part_lse = torch.empty(plan.parts, rows) if plan.parts else None
        base = MlaDecodeArgs(
            cache=kv_cache.data_ptr(), q=q.data_ptr(), out=out.data_ptr(),
            lse=None if lse is None else lse.data_ptr(), block_table=block_table.data_ptr(),
            seq_lens=seq_lens.data_ptr(), merge=plan.merge.data_ptr(),
            part_out=None if part_out is None else part_out.data_ptr(),
            part_lse=None if part_lse is None else part_lse.data_ptr(),
            batch=batch, qlen=qlen, heads=heads, rank=kv_lora_rank, rope=dim - kv_lora_rank,
            num_blocks=kv_cache.shape[0], block_size=kv_cache.shape[1],
            block_stride=kv_cache.stride(0), row_stride=kv_cache.stride(1),
            bt_stride=block_table.stride(0), q_sb=q.stride(0), q_si=q.stride(1),
            q_sh=q.stride(2), n_merge=plan.merge.shape[0], cache_dt=cache_dt,
            q_dt=codes(q.dtype), out_dt=codes(out.dtype),
            bf16_dot=int(bf16_dot),
            q_mult=softmax_scale * k_scale * _LOG2E, v_mult=k_scale)
        floats = int(self._scratch_floats(qlen, heads, kv_lora_rank, dim - kv_lora_rank))
        use_openmp = self.openmp and (openmp or (openmp is None and same_process()))
        failed = (self._shares_on_openmp if use_openmp else self._shares_on_pool)(
            base, plan, floats)
        if not failed and plan.parts and self._merge(ctypes.byref(base)):
            failed = True
        if failed:
            raise ValueError(f"native CPU decode kernel refused the call (dtypes {q.dtype}/"
                             f"{kv_cache.dtype}/{out.dtype}, kv_lora_rank {kv_lora_rank}, "
                             f"head dim {dim}): expected rank % 64 == 0 and rope % 32 == 0")

    def _cache_code(self, kv_cache: torch.Tensor, kv_cache_format: str, rank: int,
                    dim: int) -> int:
        """The kernel's ``cache_dt`` for this cache (``ValueError`` for a tensor that is not
        the layout named)."""
        if kv_cache_format == "fp8_ds_mla":
            width = ds_mla_row_bytes(rank, dim - rank)
            if kv_cache.dtype != torch.uint8 or int(kv_cache.shape[-1]) != width:
                raise ValueError(f"native CPU decode kernel: an fp8_ds_mla cache is uint8 rows "
                                 f"of {width} bytes, got {kv_cache.dtype} "
                                 f"{list(kv_cache.shape)}")
            return self.fp8_codes["fp8_ds_mla"]
        if kv_cache_format not in ("auto", "fp8_e4m3"):
            raise ValueError(f"native CPU decode kernel: kv_cache_format must be 'auto', "
                             f"'fp8_e4m3' or 'fp8_ds_mla', got {kv_cache_format!r}")
        if kv_cache.dtype == torch.float8_e4m3fn:
            return self.fp8_codes["fp8_e4m3"]
        return self.library.dtype_code(kv_cache.dtype)

    def _shares_on_openmp(self, base: MlaDecodeArgs, plan: DecodePlan, floats: int) -> bool:
        """Every share in one C call, on this thread's OpenMP team; True if refused."""
        stride = -(-floats // 16) * 16  # each share's scratch 64-byte aligned
        scratch = _scratch(stride * max(1, len(plan.shares)))  # held until the call returns
        args = MlaDecodeArgs.from_buffer_copy(base)
        args.items, args.n_items = plan.items.data_ptr(), plan.items.shape[0]
        args.scratch = scratch.data_ptr()
        return bool(self._run_shares(ctypes.byref(args), plan.share_end.data_ptr(),
                                     len(plan.shares), stride, max(1, len(plan.shares))))

    def _shares_on_pool(self, base: MlaDecodeArgs, plan: DecodePlan, floats: int) -> bool:
        """One C call per share, on the package's pool (:func:`run_shares`, which returns
        only once every share is done); True if one was refused."""
        failures: list[int] = []

        def share_of(items: torch.Tensor) -> Callable[[], None]:
            def work() -> None:
                scratch = _scratch(floats)  # held by name: the C call must not outlive it
                args = MlaDecodeArgs.from_buffer_copy(base)
                args.items, args.n_items, args.scratch = (items.data_ptr(), items.shape[0],
                                                          scratch.data_ptr())
                if self._run(ctypes.byref(args)):
                    failures.append(1)
            return work

        run_shares([share_of(items) for items in plan.shares])
        return bool(failures)


@functools.cache
def _cpu_has_bf16_dot() -> bool:
    """The CPU has AVX512-BF16 and AVX512BW (``/proc/cpuinfo``, read once per process: this
    is asked on every decode call, and the file is long on a many-core machine)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags and "avx512bw" in flags


def has_bf16_dot() -> bool:
    """Whether the kernel uses AVX512-BF16 dot products for bf16: the CPU has them (and
    AVX512BW) and ``$APP_CPU_DECODE_BF16_DOT`` does not turn them off (read on every call
    of this function: :meth:`NativeMLADecodeKernel.run` asks it per call, a
    :class:`CpuMLADecodeBackend` once, at its first run).
    AMX-BF16 does not enter: this kernel has no AMX path (an AMX CPU has AVX512-BF16 too;
    CPU_MLA's AMX kernel is ``decode_kernel_amx``, which the same switch turns off)."""
    return _cpu_has_bf16_dot() and read_switch(BF16_DOT_ENV)


def _reference(q: torch.Tensor, latent: torch.Tensor, rank: int, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's absorbed decode in float64 for the self-test: ``q [Q, H, D]``,
    ``latent [L, D]``; row ``i`` sees keys ``[0, L - Q + i]``. ``(out [Q, H, rank], lse
    [Q, H])``."""
    qlen, seq_len = q.shape[0], latent.shape[0]
    scores = torch.einsum("qhd,ld->qhl", q, latent) * scale
    hidden = torch.arange(seq_len).view(1, -1) > (torch.arange(qlen) + seq_len - qlen).view(-1, 1)
    scores = scores.masked_fill(hidden.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("qhl,lr->qhr", torch.exp(scores - lse.unsqueeze(-1)), latent[:, :rank])
    return out, lse


def _self_test_case(kernel: NativeMLADecodeKernel, gen: torch.Generator, dtype: torch.dtype,
                    tol: float, dot: bool, fmt: str) -> str | None:
    """One path of :func:`_self_test`: a small paged problem (causal, split and whole
    requests) in ``dtype`` (q, and the cache unless ``fmt`` names an FP8 layout) against
    float64 over the values the cache holds; the error text if it disagrees."""
    rank, rope, heads, qlen, bs = (256 if fmt == "fp8_ds_mla" else 64), 32, 3, 2, 5
    seq_lens = [2, 37, 700 if fmt == "auto" else 300]
    blocks = [-(-n // bs) for n in seq_lens]
    table = torch.zeros(3, max(blocks), dtype=torch.int32)
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    for b, start in enumerate([0, blocks[0], blocks[0] + blocks[1]]):
        table[b, :blocks[b]] = perm[start:start + blocks[b]]
    latent = torch.randn(sum(blocks), bs, rank + rope, generator=gen)
    if fmt == "fp8_ds_mla":   # values of very different sizes per tile: the scales matter
        latent[..., :rank] *= torch.tensor([0.01, 30.0]).repeat_interleave(128)
        cache = quantize_fp8_ds_mla(latent, rank)
        values = dequantize_fp8_ds_mla(cache, rank, rope).double()
    elif fmt == "fp8_e4m3":
        cache = latent.to(torch.float8_e4m3fn)
        values = cache.double()
    else:
        cache = latent.to(dtype)
        values = cache.double()
    q = torch.randn(3, qlen, heads, rank + rope, generator=gen).to(dtype)
    for min_keys in (MIN_KEYS_PER_PART, 64):
        plan = plan_decode(seq_lens, 2, min_keys)
        out = torch.empty(3, qlen, heads, rank, dtype=dtype)
        lse = torch.empty(3, qlen, heads)
        kernel.run(plan, q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), rank,
                   out, lse, 0.1, 1.0, bf16_dot=dot, kv_cache_format=fmt)
        for b, n in enumerate(seq_lens):
            pos = torch.arange(n)
            rows = values[table[b].long()[pos // bs], pos % bs]
            ref, ref_lse = _reference(q[b].double(), rows, rank, 0.1)
            # the output relative to the values' size (p is rounded to bf16 on the dot path)
            size = max(1.0, float(rows[:, :rank].abs().max()))
            err = max((out[b].double() - ref).abs().max().item() / size,
                      (lse[b].double() - ref_lse).abs().max().item())
            if not err < tol:
                return (f"self-test against float64 failed: max error {err:.3g} "
                        f"({dtype}{', bf16 dot' if dot else ''}"
                        f"{', ' + fmt + ' cache' if fmt != 'auto' else ''}, request {b}, "
                        f"{plan.parts} partial results)")
    return None


def _self_test(library: NativeLibrary) -> str | None:
    """Small paged problems (bf16, fp32, fp8_e4m3 and fp8_ds_mla caches; the dot products
    where the CPU has them) against float64; the first error text, if any."""
    kernel = NativeMLADecodeKernel(library)
    gen = torch.Generator().manual_seed(0)
    paths = [(torch.float32, 1e-4, False, "auto"), (torch.bfloat16, 3e-2, False, "auto"),
             (torch.float32, 1e-4, False, "fp8_e4m3"), (torch.float32, 1e-4, False, "fp8_ds_mla")]
    if has_bf16_dot():
        paths += [(torch.bfloat16, 3e-2, True, "auto"), (torch.bfloat16, 3e-2, True, "fp8_e4m3"),
                  (torch.bfloat16, 3e-2, True, "fp8_ds_mla")]
    for dtype, tol, dot, fmt in paths:
        failed = _self_test_case(kernel, gen, dtype, tol, dot, fmt)
        if failed is not None:
            return failed
    return None


def _openmp_requirements() -> list[str]:
    """Why the OpenMP build cannot run here: the kernel's own reasons, the switch, and
    torch's OpenMP runtime when it is not a ``libgomp.so.1`` (one runtime per process)."""
    reasons = _requirements()
    if not read_switch(OPENMP_ENV):
        reasons.append(f"turned off by {OPENMP_ENV}=0")
    elif torch_libgomp()[0] is None:
        reasons.append(torch_libgomp()[1])
    return reasons


def _openmp_self_test(library: NativeLibrary) -> str | None:
    """Built with OpenMP, bound to the ``libgomp.so.1`` torch runs on (the address of
    ``omp_get_max_threads``), then :func:`_self_test` on the OpenMP path."""
    if not library.function("mla_decode_cpu_openmp", _i32)():
        return "the compiler ignored -fopenmp"
    runtime, why = torch_libgomp()
    if runtime is None:
        return why
    ours = library.function("mla_decode_cpu_openmp_runtime", _ptr)()
    torchs = runtime_function_address(runtime, "omp_get_max_threads")
    if ours is None or ours != torchs:
        return (f"bound to another OpenMP runtime than torch's {runtime} (omp_get_max_threads "
                f"at {ours or 0:#x}, torch's at {torchs or 0:#x})")
    return _self_test(library)


_BUILD_FLAGS = ("-O3", "-mavx512f", "-mfma", "-mf16c")
#: The decode kernel's library, for :func:`app.backends.cpu.loader.load_native_library`:
#: the build whose shares run on the package's pool (where OpenMP cannot be used).
SPEC = NativeLibrarySpec(
    name="mla_decode_cpu", sources=("mla_decode_cpu.c",), abi_version=ABI_VERSION,
    flags=_BUILD_FLAGS, structs=(("mla_decode_args", MlaDecodeArgs),), self_test=_self_test,
    requirements=_requirements, switches=(SWITCH_ENV, BF16_DOT_ENV))
#: The same source with ``-fopenmp`` (its own cache file): shares on torch's OpenMP team.
SPEC_OPENMP = NativeLibrarySpec(
    name="mla_decode_cpu_openmp", sources=SPEC.sources, abi_version=ABI_VERSION,
    flags=(*_BUILD_FLAGS, "-fopenmp"), link_flags=("-fopenmp", "-lm"), structs=SPEC.structs,
    self_test=_openmp_self_test, requirements=_openmp_requirements,
    switches=(SWITCH_ENV, BF16_DOT_ENV, OPENMP_ENV))

_kernel_lock = threading.Lock()
_kernel: list[tuple[NativeLibrary, NativeMLADecodeKernel]] = []


def decode_kernel_status() -> tuple[NativeLibraryStatus, str]:
    """The library the decode kernel runs (the OpenMP build where it loads, else the pool
    build) and how its shares run: ``on torch's OpenMP threads (libgomp.so.1)`` or ``on the
    package's thread pool (OpenMP build unavailable: <why>)``. Builds on first use."""
    openmp = load_native_library(SPEC_OPENMP)
    if openmp.available:
        return openmp, f"on torch's OpenMP threads ({LIBGOMP})"
    return load_native_library(SPEC), ("on the package's thread pool (OpenMP build "
                                       f"unavailable: {'; '.join(openmp.reasons)})")


def load_decode_kernel() -> NativeMLADecodeKernel | None:
    """The decode kernel, built and loaded on first use; None where it cannot be (see
    :func:`decode_kernel_status`)."""
    library = decode_kernel_status()[0].library
    if library is None:
        return None
    with _kernel_lock:
        if not _kernel or _kernel[0][0] is not library:
            _kernel[:] = [(library, NativeMLADecodeKernel(library))]
        return _kernel[0][1]
