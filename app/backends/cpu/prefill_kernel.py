"""The native CPU MLA prefill kernel: ``csrc/mla_prefill_cpu.c``, built at first use.

TORCH_SDPA runs float32 CPU prefill through this kernel where it can (an x86-64 CPU with
AVX-512 and a C compiler), and through the aten CPU flash kernel otherwise. Why a kernel of
our own: aten's kernel needs ``v`` zero-padded from 128 to 192 columns (1/6 of the FLOPs
wasted), computes whole 512-key blocks on the causal diagonal, and its small per-block BLAS
calls run well below the machine's matmul rate. The two side by side: ``python -m app bench
prefill`` and docs/benchmarks.md.

The library is built, cached, checked (ABI version, the argument struct's layout, a float64
self-test) and loaded by :mod:`app.backends.cpu.loader` (its docstring says where it is
cached and what is trusted). Arguments go to C as one ``mla_prefill_args`` struct
(:class:`MlaPrefillArgs`). ctypes releases the GIL during the call: the (request, head) items
are split into ``torch.get_num_threads()`` shares run by
:func:`app.backends.cpu.pool.run_shares`, which is safe for any number of concurrent
callers and returns only when every share is done. NaN and inf follow the rule of
:mod:`app.backends.prefill._dense` (a non-finite score poisons its row; keys a row does
not see never reach it, not even as ``0 * NaN``). ``APP_CPU_NATIVE_KERNEL=0`` turns the
kernel off. A kernel that cannot be built or loaded is not an error:
:func:`native_kernel_status` says why, and callers fall back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from app.backends.cpu.loader import (
    NativeLibrary,
    NativeLibrarySpec,
    cpu_flags,
    load_native_library,
    read_switch,
    reset_native_libraries,
)
from app.backends.cpu.pool import run_shares
from app.backends.cpu.scratch import thread_scratch

logger = logging.getLogger(__name__)

__all__ = [
    "SPEC",
    "SWITCH_ENV",
    "MlaPrefillArgs",
    "NativeKernelStatus",
    "NativeMLAPrefillKernel",
    "NativePlan",
    "enabled_by_environment",
    "load_native_kernel",
    "native_kernel_status",
]

#: The on/off switch of the native kernel (default on): ``0`` (or false/off/no) keeps
#: TORCH_SDPA on the aten CPU kernel, ``1`` (or true/on/yes) allows the native one.
SWITCH_ENV = "APP_CPU_NATIVE_KERNEL"
#: The kernel's p.v tiles are 64 output columns wide.
V_HEAD_DIM_MULTIPLE = 64
#: ``MLA_PREFILL_CPU_ABI`` in ``csrc/mla_prefill_cpu.h``.
ABI_VERSION = 2

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class MlaPrefillArgs(ctypes.Structure):
    """``mla_prefill_args`` of ``csrc/mla_prefill_cpu.h`` (layout checked at load)."""

    _fields_ = [
        ("q", _ptr), ("k", _ptr), ("v", _ptr), ("out", _ptr), ("lse", _ptr),
        ("q_start", _ptr), ("q_len", _ptr), ("kv_start", _ptr), ("kv_len", _ptr),
        ("items", _ptr), ("scratch", _ptr),
        ("q_row", _i64), ("q_head", _i64), ("k_row", _i64), ("k_head", _i64),
        ("v_row", _i64), ("v_head", _i64), ("o_row", _i64), ("o_head", _i64),
        ("lse_head", _i64), ("n_items", _i64), ("d", _i64), ("dv", _i64),
        ("in_dt", _i32), ("out_dt", _i32), ("causal", _i32), ("scale", ctypes.c_float)]


@attrs.frozen
class NativeKernelStatus:
    """Whether the native kernel is usable here; if not, every reason why. ``library``: the
    loaded file; ``notes``: what the user should hear of even so (a refused cache directory,
    a rebuilt corrupt file)."""

    available: bool
    reasons: tuple[str, ...] = ()
    library: Path | None = None
    notes: tuple[str, ...] = ()


class NativeMLAPrefillKernel:
    """A loaded kernel library: ragged float32 MLA attention on the CPU."""

    def __init__(self, library: NativeLibrary) -> None:
        self.path = library.path
        self._attend = library.function("mla_prefill_cpu_attend", _i32,
                                        ctypes.POINTER(MlaPrefillArgs))
        self._scratch_floats = library.function("mla_prefill_cpu_scratch_floats", _i64,
                                                _i64, _i64, _i64, _i64)
        #: Element types the kernel reads and writes, with the library's codes for them.
        self.dtype_codes = dict(library.dtype_codes)

    def plan(self, q_starts: Sequence[int], q_lens: Sequence[int], kv_starts: Sequence[int],
             kv_lens: Sequence[int], *, total_q: int, total_kv: int, num_heads: int,
             head_dim: int, v_head_dim: int) -> NativePlan:
        """The step's work split, reusable by every layer of the step (flashinfer's plan).

        Request ``b`` is rows ``q_starts[b]:+q_lens[b]`` of a ``[total_q, H, D]`` q against
        rows ``kv_starts[b]:+kv_lens[b]`` of ``[total_kv, H, D]`` k / ``[total_kv, H, Dv]`` v.
        The (request, head) items are dealt costliest first, round-robin, onto
        ``torch.get_num_threads()`` shares (shares differ by at most one item's cost).
        """
        if v_head_dim % V_HEAD_DIM_MULTIPLE:
            raise ValueError(f"native CPU kernel: expected a v head dim that is a multiple of "
                             f"{V_HEAD_DIM_MULTIPLE}, got {v_head_dim}")
        if not len(q_starts) == len(q_lens) == len(kv_starts) == len(kv_lens):
            raise ValueError("native CPU kernel: expected as many starts as lengths, got "
                             f"{len(q_starts)}/{len(q_lens)}/{len(kv_starts)}/{len(kv_lens)}")
        for b in range(len(q_lens)):
            for what, start, n, total in (("query", q_starts[b], q_lens[b], total_q),
                                          ("kv", kv_starts[b], kv_lens[b], total_kv)):
                if start < 0 or n < 0 or start + n > total:
                    raise ValueError(f"native CPU kernel: request {b}'s {what} rows "
                                     f"[{start}, {start + n}) are outside [0, {total})")
        live = sorted((b for b in range(len(q_lens)) if q_lens[b]),
                      key=lambda b: q_lens[b] * max(kv_lens[b], 1), reverse=True)
        lengths = torch.tensor([list(q_starts), list(q_lens), list(kv_starts), list(kv_lens)],
                               dtype=torch.int64)
        items = torch.tensor([(b, h) for b in live for h in range(num_heads)],
                             dtype=torch.int64).reshape(-1, 2)
        workers = max(1, min(torch.get_num_threads(), items.shape[0]))
        shares = tuple(items[w::workers].contiguous() for w in range(workers)) if live else ()
        scratch = tuple(self._scratch_floats(max(q_lens[b] for b in requests),
                                             max(kv_lens[b] for b in requests), head_dim,
                                             v_head_dim)
                        for requests in (set(share[:, 0].tolist()) for share in shares))
        return NativePlan(lengths, shares, scratch, (total_q, total_kv, num_heads, head_dim,
                                                     v_head_dim))

    def run(self, plan: NativePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Attention of every request of ``plan``, written into ``out`` and ``lse``.

        ``q: [total_q, H, D]``, ``k: [total_kv, H, D]``, ``v: [total_kv, H, Dv]`` of one
        dtype and ``out: [total_q, H, Dv]`` of any (float32, bfloat16 or float16; computed
        in float32), on the CPU with a unit-stride last dim (other strides free: ``v`` may be
        a view into a wider tensor); ``lse: [H, total_q]`` float32 with unit stride along the
        tokens (natural log). ``causal`` is bottom-right aligned. A query that sees no key
        gets a zero row and LSE ``-inf``. Each share is one kernel call on its own thread.
        """
        self._check(plan, q, k, v, out, lse)
        if not plan.shares:
            return
        lengths = plan.lengths
        fixed = MlaPrefillArgs(
            q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
            lse=lse.data_ptr(), q_start=lengths[0].data_ptr(), q_len=lengths[1].data_ptr(),
            kv_start=lengths[2].data_ptr(), kv_len=lengths[3].data_ptr(),
            q_row=q.stride(0), q_head=q.stride(1), k_row=k.stride(0), k_head=k.stride(1),
            v_row=v.stride(0), v_head=v.stride(1), o_row=out.stride(0), o_head=out.stride(1),
            lse_head=lse.stride(0), d=q.shape[2], dv=v.shape[2],
            in_dt=self.dtype_codes[q.dtype], out_dt=self.dtype_codes[out.dtype],
            causal=int(causal), scale=scale)

        def share_of(items: torch.Tensor, floats: int) -> Callable[[], None]:
            def work() -> None:
                # No torch op that may parallelise here (see _native_pool).
                scratch = _scratch(floats)  # held by name: the C call must not outlive it
                args = MlaPrefillArgs.from_buffer_copy(fixed)
                args.items, args.n_items = items.data_ptr(), items.shape[0]
                args.scratch = scratch.data_ptr()
                if self._attend(ctypes.byref(args)) != 0:  # pragma: no cover - _check ran
                    raise RuntimeError("native CPU kernel: the library refused its arguments")
            return work

        # Every tensor the C code touches stays referenced here until run_shares returns,
        # and it returns only when every share is done.
        run_shares([share_of(items, floats)
                    for items, floats in zip(plan.shares, plan.scratch_floats, strict=True)])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_starts: Sequence[int], q_lens: Sequence[int], kv_starts: Sequence[int],
               kv_lens: Sequence[int], causal: bool, scale: float, out: torch.Tensor,
               lse: torch.Tensor) -> None:
        """:meth:`plan` then :meth:`run`, for a one-off call."""
        plan = self.plan(q_starts, q_lens, kv_starts, kv_lens, total_q=q.shape[0],
                         total_kv=k.shape[0], num_heads=q.shape[1], head_dim=q.shape[2],
                         v_head_dim=v.shape[2])
        self.run(plan, q, k, v, causal, scale, out, lse)

    def _check(self, plan: NativePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor) -> None:
        # The C code trusts every pointer and length it gets: check them all here.
        for name, t, rank, dtypes in (
                ("q", q, 3, tuple(self.dtype_codes)), ("k", k, 3, (q.dtype,)),
                ("v", v, 3, (q.dtype,)), ("out", out, 3, tuple(self.dtype_codes)),
                ("lse", lse, 2, (torch.float32,))):
            if t.dtype not in dtypes or t.device.type != "cpu" or t.dim() != rank:
                allowed = "/".join(str(x).removeprefix("torch.") for x in dtypes)
                raise ValueError(f"native CPU kernel: expected {name} a {rank}-d {allowed} CPU "
                                 f"tensor, got {tuple(t.shape)} {t.dtype} on {t.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"native CPU kernel: expected {name} with a unit-stride last "
                                 f"dim, got strides {t.stride()}")
        total_q, total_kv, heads, d, dv = plan.shape
        expected = {"q": (total_q, heads, d), "k": (total_kv, heads, d),
                    "v": (total_kv, heads, dv), "out": (total_q, heads, dv),
                    "lse": (heads, total_q)}
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"native CPU kernel: expected {name} of shape "
                                 f"{expected[name]}, got {tuple(t.shape)}")


@attrs.frozen(eq=False)
class NativePlan:
    """A step's work split for :meth:`NativeMLAPrefillKernel.run`.

    ``lengths: [4, batch]`` int64 (q starts, q lens, kv starts, kv lens); ``shares``: one
    ``[n, 2]`` int64 (request, head) array per worker thread; ``scratch_floats``: each
    share's scratch size; ``shape``: ``(total_q, total_kv, H, D, Dv)`` the tensors must have.
    """

    lengths: torch.Tensor
    shares: tuple[torch.Tensor, ...]
    scratch_floats: tuple[int, ...]
    shape: tuple[int, int, int, int, int]


#: Largest per-thread scratch buffer kept between calls (fresh pages cost page faults).
SCRATCH_KEEP_BYTES = 256 << 20


def _scratch(floats: int) -> torch.Tensor:
    """This thread's scratch of at least ``floats`` float32s (``cpu.scratch``)."""
    return thread_scratch(floats, SCRATCH_KEEP_BYTES)


# -- building and loading -----------------------------------------------------------------

def enabled_by_environment() -> bool:
    """``$APP_CPU_NATIVE_KERNEL`` read strictly: unset/1/true/on/yes or 0/false/off/no."""
    return read_switch(SWITCH_ENV)


def _requirements() -> list[str]:
    """Why the kernel cannot run here, besides a missing C compiler (the loader's check)."""
    reasons = []
    if not enabled_by_environment():
        reasons.append(f"turned off by {SWITCH_ENV}={os.environ.get(SWITCH_ENV)}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        reasons.append(f"needs an x86-64 CPU, this is {platform.machine()}")
    elif not _cpu_has_avx512():
        reasons.append("needs a CPU with AVX-512 (avx512f), this one has none")
    return reasons


def _cpu_has_avx512() -> bool:
    flags = cpu_flags()
    if flags:
        return "avx512f" in flags
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def _self_test(library: NativeLibrary) -> str | None:
    """A small ragged causal problem against float64; the error text if it disagrees."""
    kernel = NativeMLAPrefillKernel(library)
    gen = torch.Generator().manual_seed(0)
    q_lens, kv_lens = (37, 5, 130), (37, 9, 130)
    q_starts, kv_starts = [0, 37, 42], [0, 37, 46]
    q = torch.randn(sum(q_lens), 3, 80, generator=gen)
    k = torch.randn(sum(kv_lens), 3, 80, generator=gen)
    v = torch.randn(sum(kv_lens), 3, 64, generator=gen)
    out, lse = torch.empty(q.shape[0], 3, 64), torch.empty(3, q.shape[0])
    # bf16 in and out too: the conversions are the kernel's own code as well.
    out16 = torch.empty(q.shape[0], 3, 64, dtype=torch.bfloat16)
    kernel.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_starts, q_lens, kv_starts,
                  kv_lens, True, 0.1, out16, torch.empty(3, q.shape[0]))
    kernel.attend(q, k, v, q_starts, q_lens, kv_starts, kv_lens, True, 0.1, out, lse)
    for b in range(3):
        qs, ks = q_starts[b], kv_starts[b]
        qb = q[qs:qs + q_lens[b]].double().transpose(0, 1)
        kb = k[ks:ks + kv_lens[b]].double().transpose(0, 1)
        vb = v[ks:ks + kv_lens[b]].double().transpose(0, 1)
        s = (qb @ kb.transpose(1, 2)) * 0.1
        hidden = torch.ones(q_lens[b], kv_lens[b], dtype=torch.bool).triu(
            kv_lens[b] - q_lens[b] + 1)
        s = s.masked_fill(hidden, float("-inf"))
        ref_lse = torch.logsumexp(s, -1)
        ref = (torch.softmax(s, -1) @ vb).transpose(0, 1)
        rows = slice(qs, qs + q_lens[b])
        err = max((out[rows].double() - ref).abs().max().item(),
                  (lse[:, rows].double() - ref_lse).abs().max().item())
        # bf16 inputs vs the float32 result: input rounding (2^-9 relative) dominates.
        err16 = (out16[rows].double() - out[rows].double()).abs().max().item()
        if not (err < 1e-4 and err16 < 5e-2):
            return (f"self-test against float64 failed: max error {err:.3g} (float32), "
                    f"{err16:.3g} (bfloat16) in request {b}")
    return None


#: The prefill kernel's library, for :func:`app.backends.cpu.loader.load_native_library`.
SPEC = NativeLibrarySpec(
    name="mla_prefill_cpu", sources=("mla_prefill_cpu.c",), abi_version=ABI_VERSION,
    flags=("-O3", "-mavx512f", "-mfma", "-mf16c"),
    structs=(("mla_prefill_args", MlaPrefillArgs),), self_test=_self_test,
    requirements=_requirements, switches=(SWITCH_ENV,))

_kernel_lock = threading.Lock()
_kernel: list[tuple[NativeLibrary, NativeMLAPrefillKernel]] = []  # the library it wraps


def load_native_kernel() -> NativeMLAPrefillKernel | None:
    """The kernel, built and loaded on the first call in a process; None where it cannot be
    (see :func:`native_kernel_status`; the reason is logged once at INFO). Raises
    ``ValueError`` for an unrecognised ``$APP_CPU_NATIVE_KERNEL`` (nothing is cached then)."""
    library = load_native_library(SPEC).library
    if library is None:
        return None
    with _kernel_lock:
        if not _kernel or _kernel[0][0] is not library:  # first use, or a reset loader
            _kernel[:] = [(library, NativeMLAPrefillKernel(library))]
        return _kernel[0][1]


def native_kernel_status() -> NativeKernelStatus:
    """Whether :func:`load_native_kernel` gives a kernel (building it if not yet tried)."""
    status = load_native_library(SPEC)
    return NativeKernelStatus(status.available, status.reasons, status.path, status.notes)


def _reset_for_tests() -> None:
    """Forget the loaded kernel, so the next call probes and builds again."""
    reset_native_libraries(SPEC.name)
    with _kernel_lock:
        _kernel.clear()
