"""The native CPU MLA prefill kernel: ``_native/mla_prefill_cpu.c``, built at first use.

TORCH_SDPA runs float32 CPU prefill through this kernel where it can (an x86-64 CPU with
AVX-512 and a C compiler), and through the aten CPU flash kernel otherwise. Why a kernel of
our own: aten's kernel needs ``v`` zero-padded from 128 to 192 columns (1/6 of the FLOPs
wasted), computes whole 512-key blocks on the causal diagonal, and its small per-block BLAS
calls run well below the machine's matmul rate; it measured ~0.55 of the fp32 matmul rate
on 1 x 4096 causal on a 2-core AVX-512 machine, this kernel 0.76-0.84
(``python -m app bench prefill``, against a matmul timed beside each call; docs/benchmarks.md).

The library is compiled once per (source, compiler, flags) into a cache directory
(``$APP_CACHE_DIR``, else ``$XDG_CACHE_HOME/app``, else ``~/.cache/app``), checked against a
float64 reference on a small problem, and loaded with ctypes, which releases the GIL during
the call: ``torch.get_num_threads()`` Python threads each run their share of the (request,
head) items. ``APP_CPU_NATIVE_KERNEL=0`` turns it off. A kernel that cannot be built or
loaded is not an error: :func:`native_kernel_status` says why, and callers fall back.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import attrs
import torch

logger = logging.getLogger(__name__)

__all__ = ["DISABLE_ENV", "NativeKernelStatus", "NativeMLAPrefillKernel", "NativePlan",
           "enabled_by_environment", "load_native_kernel", "native_kernel_status"]

#: Set to ``0`` (or false/off/no) to keep TORCH_SDPA on the aten CPU kernel.
DISABLE_ENV = "APP_CPU_NATIVE_KERNEL"
_ENV_VALUES = {"": True, "1": True, "true": True, "on": True, "yes": True,
               "0": False, "false": False, "off": False, "no": False}
_SOURCE = Path(__file__).with_name("_native") / "mla_prefill_cpu.c"
_FLAGS = ("-O3", "-mavx512f", "-mfma", "-mf16c", "-fPIC", "-shared")
#: The kernel's p.v tiles are 64 output columns wide.
V_HEAD_DIM_MULTIPLE = 64

_c_long, _c_ptr = ctypes.c_long, ctypes.c_void_p
#: The element types the kernel reads and writes (its DT_* codes); it computes in float32.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@attrs.frozen
class NativeKernelStatus:
    """Whether the native kernel is usable here; if not, every reason why."""

    available: bool
    reasons: tuple[str, ...] = ()
    library: Path | None = None


class NativeMLAPrefillKernel:
    """A loaded kernel library: ragged float32 MLA attention on the CPU."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._attend = library.mla_cpu_attend
        self._attend.restype = None
        c_int, c_float = ctypes.c_int, ctypes.c_float
        self._attend.argtypes = [
            _c_ptr, _c_long, _c_long, _c_ptr, _c_long, _c_long, _c_ptr, _c_long, _c_long,
            c_int, _c_long, _c_long, c_int, c_float, _c_ptr, _c_long, _c_long, c_int, _c_ptr,
            _c_long, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_long, _c_ptr]
        self._scratch_floats = library.mla_cpu_scratch_floats
        self._scratch_floats.restype = _c_long
        self._scratch_floats.argtypes = [_c_long, _c_long, _c_long, _c_long]

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
        fixed = (q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                 k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), DTYPE_CODES[q.dtype],
                 q.shape[2], v.shape[2], int(causal), scale, out.data_ptr(), out.stride(0),
                 out.stride(1), DTYPE_CODES[out.dtype], lse.data_ptr(), lse.stride(0),
                 *(lengths[i].data_ptr() for i in range(4)))

        def work(share: torch.Tensor, floats: int) -> None:
            # No torch op that may parallelise here: torch forbids its OpenMP pool from
            # these threads in a forked child ("Invalid thread pool").
            scratch = _scratch(floats)  # held by name: the C call must not outlive it
            self._attend(*fixed, share.data_ptr(), share.shape[0], scratch.data_ptr())

        if len(plan.shares) == 1:
            work(plan.shares[0], plan.scratch_floats[0])
            return
        pool = _pool.get(len(plan.shares))
        futures = [pool.submit(work, share, n)
                   for share, n in zip(plan.shares, plan.scratch_floats, strict=True)]
        wait(futures)  # every share done before an error surfaces: none still writes to out
        for future in futures:
            future.result()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_starts: Sequence[int], q_lens: Sequence[int], kv_starts: Sequence[int],
               kv_lens: Sequence[int], causal: bool, scale: float, out: torch.Tensor,
               lse: torch.Tensor) -> None:
        """:meth:`plan` then :meth:`run`, for a one-off call."""
        plan = self.plan(q_starts, q_lens, kv_starts, kv_lens, total_q=q.shape[0],
                         total_kv=k.shape[0], num_heads=q.shape[1], head_dim=q.shape[2],
                         v_head_dim=v.shape[2])
        self.run(plan, q, k, v, causal, scale, out, lse)

    @staticmethod
    def _check(plan: NativePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor) -> None:
        # The C code trusts every pointer and length it gets: check them all here.
        for name, t, rank, dtypes in (
                ("q", q, 3, tuple(DTYPE_CODES)), ("k", k, 3, (q.dtype,)),
                ("v", v, 3, (q.dtype,)), ("out", out, 3, tuple(DTYPE_CODES)),
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
_thread_scratch = threading.local()


def _scratch(floats: int) -> torch.Tensor:
    """This thread's scratch of at least ``floats`` float32s, reused between calls."""
    buf: torch.Tensor | None = getattr(_thread_scratch, "buf", None)
    if buf is not None and buf.numel() >= floats:
        return buf
    buf = torch.empty(floats, dtype=torch.float32)
    _thread_scratch.buf = buf if floats * 4 <= SCRATCH_KEEP_BYTES else None
    return buf


class _WorkerPool:
    """One thread pool per process, resized when ``torch.get_num_threads()`` changes and
    made anew in a forked child (whose copy of the pool has no threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._pid = 0

    def get(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size != workers or self._pid != os.getpid():
                if self._pool is not None and self._pid == os.getpid():
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="app-mla-cpu")
                self._size, self._pid = workers, os.getpid()
            return self._pool


_pool = _WorkerPool()


# -- building and loading -----------------------------------------------------------------

_load_lock = threading.Lock()
_loaded: dict[str, NativeMLAPrefillKernel | NativeKernelStatus] = {}


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" in line.split()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def enabled_by_environment() -> bool:
    """``$APP_CPU_NATIVE_KERNEL`` read strictly: unset/1/true/on/yes or 0/false/off/no."""
    raw = os.environ.get(DISABLE_ENV, "")
    value = _ENV_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"{DISABLE_ENV}: expected one of 1/true/on/yes or 0/false/off/no "
                         f"(or unset), got {raw!r}")
    return value


def _static_reasons() -> list[str]:
    reasons = []
    if not enabled_by_environment():
        reasons.append(f"turned off by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        reasons.append(f"needs an x86-64 CPU, this is {platform.machine()}")
    elif not _cpu_has_avx512():
        reasons.append("needs a CPU with AVX-512 (avx512f), this one has none")
    if _compiler() is None:
        reasons.append("needs a C compiler to build it (set CC, or install cc/gcc/clang)")
    return reasons


def _cache_dir() -> Path:
    base = os.environ.get("APP_CACHE_DIR")
    if base:
        return Path(base) / "cpu-kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "app" / "cpu-kernels"


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(_FLAGS).encode()).hexdigest()
    name = f"mla_prefill_cpu-{key[:16]}.so"
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"app-{os.getuid()}"):
        target = directory / name
        if target.is_file():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        tmp = directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        proc = subprocess.run([compiler, *_FLAGS, "-o", str(tmp), str(_SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder never loads a partial file
        return target
    raise RuntimeError(f"no writable cache directory ({_cache_dir()}, {tempfile.gettempdir()})")


def _self_test(kernel: NativeMLAPrefillKernel) -> str | None:
    """A small ragged causal problem against float64; the error text if it disagrees."""
    gen = torch.Generator().manual_seed(0)
    q_lens, kv_lens = (37, 5, 130), (37, 9, 130)
    q = torch.randn(sum(q_lens), 3, 80, generator=gen)
    k = torch.randn(sum(kv_lens), 3, 80, generator=gen)
    v = torch.randn(sum(kv_lens), 3, 64, generator=gen)
    out, lse = torch.empty(q.shape[0], 3, 64), torch.empty(3, q.shape[0])
    # bf16 in and out too: the conversions are the kernel's own code as well.
    out16 = torch.empty(q.shape[0], 3, 64, dtype=torch.bfloat16)
    kernel.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), [0, 37, 42], q_lens, [0, 37, 46],
                  kv_lens, True, 0.1, out16, torch.empty(3, q.shape[0]))
    q_starts = [0, 37, 42]
    kv_starts = [0, 37, 46]
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


def _load() -> NativeMLAPrefillKernel | NativeKernelStatus:
    reasons = _static_reasons()
    if reasons:
        return NativeKernelStatus(False, tuple(reasons))
    compiler = _compiler()
    if compiler is None:  # pragma: no cover - _static_reasons checked it
        return NativeKernelStatus(False, ("no C compiler",))
    try:
        path = _build(compiler)
        kernel = NativeMLAPrefillKernel(ctypes.CDLL(str(path)), path)
        failure = _self_test(kernel)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return NativeKernelStatus(False, (f"could not build or load it: {exc}",))
    if failure:
        return NativeKernelStatus(False, (failure,), path)
    return kernel


def load_native_kernel() -> NativeMLAPrefillKernel | None:
    """The kernel, built and loaded on the first call in a process; None where it cannot be
    (see :func:`native_kernel_status`; the reason is logged once at INFO). Raises
    ``ValueError`` for an unrecognised ``$APP_CPU_NATIVE_KERNEL`` (nothing is cached then)."""
    with _load_lock:
        result = _loaded.get("kernel")
        if result is None:
            result = _load()
            _loaded["kernel"] = result
            if isinstance(result, NativeKernelStatus):
                logger.info("native CPU MLA kernel unavailable: %s", "; ".join(result.reasons))
    return result if isinstance(result, NativeMLAPrefillKernel) else None


def native_kernel_status() -> NativeKernelStatus:
    """Whether :func:`load_native_kernel` gives a kernel (building it if not yet tried)."""
    kernel = load_native_kernel()
    if kernel is not None:
        return NativeKernelStatus(True, (), kernel.path)
    status = _loaded["kernel"]
    return status if isinstance(status, NativeKernelStatus) else NativeKernelStatus(False)


def _reset_for_tests() -> None:
    """Forget the loaded kernel, so the next call probes and builds again."""
    with _load_lock:
        _loaded.clear()
