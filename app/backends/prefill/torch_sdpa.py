"""TORCH_SDPA: MLA prefill on torch's own fused attention kernels; runs everywhere.

**CPU with AVX-512 and a C compiler** (the default there): the native
kernel of :mod:`app.backends.cpu.prefill_kernel` (``cpu/csrc/mla_prefill_cpu.c``, built at
first use;
``cpu_native_kernel = False`` or ``APP_CPU_NATIVE_KERNEL=0`` turns it off). No padded ``v``,
only the causal diagonal's 14 x 32 tiles are masked, bottom-right causal and empty rows
handled in the kernel; fp16 (and bf16 on CPUs without AVX512-BF16) are converted while packing
(float32 math). bf16 inputs on a CPU with AVX512-BF16 take the kernel's bf16-products build
(:mod:`app.backends.cpu.prefill_kernel_bf16`: q.k and p.v through ``vdpbf16ps``, float32
accumulation,
probabilities rounded to bf16; ``cpu_bf16_kernel = False`` or ``APP_CPU_BF16_KERNEL=0`` turns
it off). Its speed against aten's kernel and against this CPU's measured FMA / bf16
dot-product peaks: ``python -m app bench prefill`` and docs/benchmarks.md.

**bf16 on a CPU with AMX tiles**: aten's bf16 flash kernel runs its blocks through oneDNN,
which uses AMX there, so TORCH_SDPA times both paths once per machine, keeps the timings beside
the native library and takes the faster in every process
(:mod:`app.backends.prefill.cpu_bf16_path`; ``APP_CPU_PREFILL_PATH`` forces one or measures
anew; ``APP_CPU_AMX=0`` takes the native kernel, or aten in float32 where only aten runs);
:meth:`TorchSDPAPrefillBackend.kernel_path` says which and why.

**CPU otherwise** (no AVX-512 or compiler, the native kernel switched off): aten's CPU flash
kernel, whose quirks (equal head dims, top-left ``is_causal``, LSE 0 on rows that see no key)
:mod:`app.backends.prefill._aten_cpu` works around, per call
size: plain-matmul blocks for short float32
causal calls (``cpu_blocked_rows``), masked chunks for other short causal calls
(``cpu_causal_chunk``, up to ``cpu_chunked_causal_max`` rows), one ``is_causal`` call merged by
LSE for long ones. A NaN or inf in a key or value goes to the dense per-request path
(:mod:`app.backends.prefill._dense`), which keeps to the non-finite rule. The measured gains of each
path and why each threshold has its value: docs/benchmarks.md ("TORCH_SDPA on CPU: paths and
thresholds").

**CUDA**: torch's varlen flash kernel (``aten::_flash_attention_forward``, v padded to the
q/k head dim, fp16/bf16, head dim <= 256), else the varlen memory-efficient kernel
(``aten::_efficient_attention_forward``, bottom-right causal mask type), else a per-request float32
matmul-softmax-matmul: ``cuda_kernel`` decides from the device capability passed in at construction
and the head dims; a kernel's run-time error (out of memory included) propagates. Query rows that
see no key (a request without keys; with the causal mask, the first ``q_len - kv_len`` rows of a
request) are never given to a kernel: they are dropped from the call (``live_rows``) and get out 0
and LSE ``-inf`` here. The memory-efficient kernel skips its causal mask for a whole block of
query rows whose first row sees no key (it compares the block's diagonal as an unsigned number),
so the rows of that block that do see keys attended keys past their diagonal: on an H100 in
float32 the kit's ``q_longer_than_kv`` case was off by 3.9 (out) and 5.7 (LSE) before this
(docs/gpu-results.md). Run on a GPU once, on the code before this fix; see docs/gpu-results.md.

No path syncs with the device per request: lengths come from the host copies of the
``cu_seqlens`` read once in ``prepare_metadata``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from app._cpu import detect_cpu_features
from app._types import DeviceCapability
from app.backends.cpu.amx import AMX_ENV, amx_turned_off, cpu_has_amx
from app.backends.cpu.child_verdict import machine_key
from app.backends.cpu.loader import cpu_flags
from app.backends.cpu.prefill_kernel import (
    V_HEAD_DIM_MULTIPLE,
    NativeMLAPrefillKernel,
    NativePlan,
    load_native_kernel,
    native_kernel_status,
)
from app.backends.cpu.prefill_kernel_bf16 import (
    load_native_bf16_kernel,
    native_bf16_kernel_status,
)
from app.backends.prefill._aten_cpu import AtenCpuPrefill, amx_held_off, cpu_compute_dtype
from app.backends.prefill._dense import all_finite, attend_dense
from app.backends.prefill.cpu_bf16_path import (
    ATEN,
    NATIVE,
    Bf16PrefillPath,
    CalibrationFile,
    bf16_prefill_path,
)
from app.backends.prefill.kernel_base import RaggedKernelBackend, RaggedLayout, unit_stride
from app.backends.prefill.metadata import MLAPrefillMetadata

if TYPE_CHECKING:
    from app.backends.workspaces import KernelWorkspaces
    from app.config import EngineConfig

__all__ = ["LiveRows", "TorchSDPABackend", "TorchSDPAPrefillBackend", "aten_cpu_path",
           "cpu_bf16_prefill_path", "cpu_compute_dtype", "live_rows"]

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")


@attrs.frozen
class LiveRows:
    """The query rows of a ragged call that see at least one key, as a call of their own.

    ``layout`` is the call with every row that sees no key dropped (each request keeps its last
    ``min(q_len, kv_len)`` rows under a causal mask, all of its rows otherwise, none without
    keys); ``index [layout.total_q]`` (int64, on the call's device) is where each of its rows
    sits in the full call. With bottom-right causal masks the kept rows see what they saw:
    dropping a request's first ``q_len - kv_len`` rows makes its ``q_len`` equal ``kv_len``."""

    layout: RaggedLayout
    index: torch.Tensor


def live_rows(layout: RaggedLayout, causal: bool, device: torch.device) -> LiveRows | None:
    """``LiveRows`` of ``layout``, or None when every query row sees a key (the usual call:
    then the kernel runs on the call as it is). Host work only, from the layout's lengths."""
    dead = layout.empty_rows(causal)
    if not dead:
        return None
    keep = torch.ones(layout.total_q, dtype=torch.bool)
    for start, stop in dead:
        keep[start:stop] = False
    q_lens = [ql - int((~keep[qs:qs + ql]).sum())
              for qs, ql in zip(layout.q_starts, layout.q_lens, strict=True)]
    cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    total_q = int(cu_q[-1])
    kept = RaggedLayout.from_cu_seqlens(
        cu_q, layout.cu_kv_cpu, cu_q if device.type == "cpu" else cu_q.to(device),
        layout.cu_kv, what="TORCH_SDPA (rows that see a key)", total_q=total_q,
        total_kv=layout.total_kv, max_q=max(q_lens, default=0), max_kv=layout.max_kv)
    index = keep.nonzero().flatten()
    return LiveRows(kept, index if device.type == "cpu" else index.to(device))


class TorchSDPAPrefillBackend(RaggedKernelBackend):
    """Torch's fused attention kernels: the CPU default and the GPU fallback."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float32)
    supports_out: ClassVar[bool] = True
    requires_device_capability: ClassVar[bool] = False
    requires_cuda: ClassVar[bool] = False
    needs_lse_buffer: ClassVar[bool] = True

    #: Use the native AVX-512 kernel on CPU where it builds (else the aten kernel below).
    cpu_native_kernel: ClassVar[bool] = True
    #: bf16 inputs on the kernel's bf16-products build where the CPU has AVX512-BF16
    #: (``APP_CPU_BF16_KERNEL=0`` or False here: the float32-math kernel instead).
    cpu_bf16_kernel: ClassVar[bool] = True
    #: Query rows per chunk of a short causal call on the aten CPU path (0: never chunk);
    #: 256 keeps the kernel's 64-row query blocks (docs/benchmarks.md).
    cpu_causal_chunk: ClassVar[int] = 256
    #: Causal calls with at most this many query rows (after dropping rows that see no key)
    #: run in chunks (or plain-matmul blocks); longer ones as one ``is_causal`` call.
    cpu_chunked_causal_max: ClassVar[int] = 768
    #: Query rows per block of the plain-matmul path for short float32 causal calls (0: use
    #: the aten kernel's chunks instead); keys past a block's last row are skipped.
    cpu_blocked_rows: ClassVar[int] = 64

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, config, device_capability=device_capability,
                         workspaces=workspaces)
        # Calls may run on several threads at once (layers of one step): the aten paths
        # share their mask caches under a lock and keep one v buffer per thread.
        self._aten = AtenCpuPrefill(
            num_heads, self.qk_head_dim, v_head_dim, self.scale,
            causal_chunk=self.cpu_causal_chunk, chunked_causal_max=self.cpu_chunked_causal_max,
            blocked_rows=self.cpu_blocked_rows)
        self._native: NativeMLAPrefillKernel | bool | None = False  # False: not looked up
        self._native_bf16: NativeMLAPrefillKernel | bool | None = False
        self._bf16_path: str | None = None  # "native" / "aten" once chosen (or forced)

    @classmethod
    def kernel_path(cls, dtype: torch.dtype) -> str:
        """On a CPU, which kernel ``dtype`` inputs run on and why: the native kernel (bf16
        products or float32 math) or aten's flash kernel (:func:`aten_cpu_path`: bf16 on
        oneDNN's AMX tiles or AVX512-BF16 products, or float32), as
        :mod:`app.backends.prefill.cpu_bf16_path` chose for bf16."""
        native = native_kernel_status()
        if dtype == torch.bfloat16 and cls.cpu_native_kernel:
            choice = cpu_bf16_prefill_path()
            if choice.path == ATEN:
                return f"{aten_cpu_path(dtype)}: {choice.reason}"
            bf16 = native_bf16_kernel_status()
            if bf16.available and cls.cpu_bf16_kernel:
                return f"native kernel, bf16 products (vdpbf16ps): {choice.reason}"
            why = "; ".join(bf16.reasons) or "cpu_bf16_kernel is False"
            return f"native kernel, float32 math (bf16 build unavailable: {why}): {choice.reason}"
        if not (native.available and cls.cpu_native_kernel):
            why = "; ".join(native.reasons) or "cpu_native_kernel is False"
            return f"{aten_cpu_path(dtype)}: native kernel unavailable: {why}"
        converted = "" if dtype == torch.float32 else \
            f", {str(dtype).removeprefix('torch.')} converted while packing"
        return f"native kernel, float32 FMAs (AVX-512F{converted})"

    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        if lse is None:  # pragma: no cover - needs_lse_buffer
            raise RuntimeError("TORCH_SDPA needs an LSE buffer")
        if q.device.type == "cpu":
            self._run_cpu(layout, q, k, v, causal, out, lse)
        elif q.device.type == "cuda":
            self._run_cuda(layout, q, k, v, causal, out, lse)
        else:
            self._run_dense(layout, q, k, v, causal, out, lse)

    # -- CPU ------------------------------------------------------------------------------

    def _native_kernel(self, dtype: torch.dtype) -> NativeMLAPrefillKernel | None:
        """The native kernel if this call can use it (looked up once per instance)."""
        # Every input dtype the kernel reads; bf16 on the bf16-products build where the CPU
        # has AVX512-BF16 (measured ~1.8x the float32 math on 1 x 4096), else float32 math
        # (which still beat aten's bf16 flash kernel).
        if not self.cpu_native_kernel or self.v_head_dim % V_HEAD_DIM_MULTIPLE:
            return None
        if dtype == torch.bfloat16:
            if self._bf16_path is None:
                self._bf16_path = cpu_bf16_prefill_path().path
            if self._bf16_path == ATEN:
                return None
        if dtype == torch.bfloat16 and self.cpu_bf16_kernel:
            if self._native_bf16 is False:
                self._native_bf16 = load_native_bf16_kernel()
            if isinstance(self._native_bf16, NativeMLAPrefillKernel):
                return self._native_bf16
        if self._native is False:
            self._native = load_native_kernel()
        kernel = self._native if isinstance(self._native, NativeMLAPrefillKernel) else None
        return kernel if kernel is not None and dtype in kernel.dtype_codes else None

    def _run_cpu_native(self, kernel: NativeMLAPrefillKernel, layout: RaggedLayout,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        result: torch.Tensor, lse: torch.Tensor) -> None:
        def unit_last(x: torch.Tensor) -> torch.Tensor:
            return x if x.stride(-1) == 1 else x.contiguous()

        def make_plan() -> NativePlan:  # one plan per step, shared by every layer
            return kernel.plan(layout.q_starts, layout.q_lens, layout.kv_starts,
                               layout.kv_lens, total_q=layout.total_q,
                               total_kv=layout.total_kv, num_heads=self.num_heads,
                               head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim)

        plan = self._step_cache.get(layout, "native-plan", make_plan)
        kernel.run(plan, unit_last(q), unit_last(k), unit_last(v), causal, self.scale, result,
                   lse)

    def _run_cpu(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool, result: torch.Tensor, lse: torch.Tensor) -> None:
        native = self._native_kernel(q.dtype)
        if native is not None:
            self._run_cpu_native(native, layout, q, k, v, causal, result, lse)
        elif not all_finite(k, v):
            # A NaN or inf in a key or value: the aten kernel would leak it from masked keys
            # (score + -inf, 0 * NaN) into every row; the dense path keeps to the rule (see
            # app.backends.prefill._dense). Corrupt input is rare, so its speed does not matter.
            self._run_dense(layout, q, k, v, causal, result, lse)
        else:
            self._aten.run(layout, q, k, v, causal, result, lse)

    # -- generic per-request fallback -----------------------------------------------------

    def _run_dense(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, causal: bool, result: torch.Tensor, lse: torch.Tensor
                   ) -> None:
        """Per-request float32 matmul-softmax-matmul (lengths from the host layout), NaN
        and inf handled by the rule of :mod:`app.backends.prefill._dense`."""
        for qs, ks, q_len, kv_len in zip(layout.q_starts, layout.kv_starts, layout.q_lens,
                                         layout.kv_lens, strict=True):
            if q_len == 0:
                continue
            if kv_len == 0:
                result[qs:qs + q_len].zero_()
                lse[:, qs:qs + q_len].fill_(_NEG_INF)
                continue
            attend_dense(q[qs:qs + q_len], k[ks:ks + kv_len], v[ks:ks + kv_len], causal,
                         self.scale, result[qs:qs + q_len], lse[:, qs:qs + q_len])

    # -- CUDA ---------------------------------------------------------------------------

    def cuda_kernel(self, dtype: torch.dtype) -> str:
        """Which CUDA path runs ``dtype`` inputs, decided from the device capability passed in
        and the head dims (never by trying a kernel and catching its error): ``"flash"``
        (SM80+, fp16/bf16, q/k head dim <= 256 and a multiple of 8, v <= q/k), else
        ``"efficient"`` (SM50+, head dims multiples of 8), else ``"dense"``.
        ``ValueError`` when the backend was built without a capability."""
        cap = self._require_capability()
        dqk, dv = self.qk_head_dim, self.v_head_dim
        half = dtype in (torch.float16, torch.bfloat16)
        if cap.major >= 8 and half and dv <= dqk <= 256 and dqk % 8 == 0:
            return "flash"
        if cap.major >= 5 and dqk % 8 == 0 and dv % 8 == 0:
            return "efficient"
        return "dense"

    def _run_cuda(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, causal: bool, result: torch.Tensor, lse: torch.Tensor
                  ) -> None:
        """The path ``cuda_kernel`` picks, on the rows that see a key (``live_rows``); the
        others get out 0 and LSE ``-inf`` whatever a kernel would make of them. A kernel's
        error (out of memory included) propagates to the caller."""
        kernel = self.cuda_kernel(q.dtype)
        if kernel == "dense":
            self._run_dense(layout, q, k, v, causal, result, lse)
            return
        live = self._step_cache.get(layout, f"live-rows-{causal}",
                                    lambda: live_rows(layout, causal, q.device))
        if live is None:
            self._run_cuda_kernel(kernel, layout, q, k, v, causal, result, lse)
            return
        result.zero_()
        lse.fill_(_NEG_INF)
        if live.layout.total_q == 0:
            return
        part = torch.empty(live.layout.total_q, self.num_heads, self.v_head_dim,
                           dtype=result.dtype, device=result.device)
        part_lse = torch.empty(self.num_heads, live.layout.total_q, dtype=lse.dtype,
                               device=lse.device)
        self._run_cuda_kernel(kernel, live.layout, q.index_select(0, live.index), k, v, causal,
                              part, part_lse)
        result.index_copy_(0, live.index, part)
        lse.index_copy_(1, live.index, part_lse)

    def _run_cuda_kernel(self, kernel: str, layout: RaggedLayout, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, causal: bool, result: torch.Tensor,
                         lse: torch.Tensor) -> None:
        """torch's flash or memory-efficient kernel on a call whose every row sees a key."""
        dqk, dv = self.qk_head_dim, self.v_head_dim
        q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
        if kernel == "flash":
            vp = v if dv == dqk else torch.nn.functional.pad(v, (0, dqk - dv))
            o, lg, *_ = torch.ops.aten._flash_attention_forward(
                q, k, vp, layout.cu_q, layout.cu_kv, layout.max_q, layout.max_kv, 0.0,
                causal, False, scale=self.scale)
            result.copy_(o[..., :dv])
            self._copy_kernel_lse(lg, layout, lse, tokens_first=False)
        elif kernel == "efficient":
            o, lg, *_ = torch.ops.aten._efficient_attention_forward(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, layout.cu_q,
                layout.cu_kv, layout.max_q, layout.max_kv, 0.0, 2 if causal else 0, True,
                scale=self.scale)
            result.copy_(o[0])
            self._copy_kernel_lse(lg, layout, lse, tokens_first=False)
        else:  # pragma: no cover - _run_cuda runs "dense" itself
            raise ValueError(f"TORCH_SDPA: no CUDA kernel {kernel!r}")


def _time_bf16_path(path: str) -> float:
    """Seconds of one calibration call (1 x 1024 new tokens, causal, 16 heads, 192/128 head
    dims, bf16, with the LSE) on ``path`` ("native" or "aten")."""
    backend = TorchSDPAPrefillBackend(num_heads=16, scale=1 / math.sqrt(192), kv_lora_rank=512,
                                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    backend._bf16_path = path
    backend.prepare_metadata(MLAPrefillMetadata.build([1024], new_kv_lens=[1024]))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1024, 16, 192, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1024, 16, 128, generator=gen).bfloat16()
    start = time.perf_counter()
    backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    return time.perf_counter() - start


def _calibration_file() -> CalibrationFile | None:
    """Where this machine's bf16 calibration is kept: beside the native kernel library,
    keyed by the CPU, the libraries the native path loads, torch's version (aten's kernel)
    and the thread count; None without a library."""
    native = native_kernel_status()
    if native.library is None:
        return None
    bf16 = native_bf16_kernel_status() if TorchSDPAPrefillBackend.cpu_bf16_kernel else None
    key = {"machine": machine_key(), "native": native.library.name,
           "native_bf16": bf16.library.name if bf16 is not None and bf16.library else "-",
           "torch": torch.__version__, "threads": str(torch.get_num_threads())}
    return CalibrationFile(native.library.parent, key)


def cpu_bf16_prefill_path() -> Bf16PrefillPath:
    """The kernel TORCH_SDPA runs bf16 prefill on here ("native" or "aten") and why
    (:mod:`app.backends.prefill.cpu_bf16_path`: on AMX CPUs measured once per machine and
    kept beside the library; native, unmeasured, with ``APP_CPU_AMX=0``)."""
    native = native_kernel_status()
    runnable = {NATIVE: None if native.available else "; ".join(native.reasons), ATEN: None}
    return bf16_prefill_path(cpu_has_amx(), runnable, _time_bf16_path,
                             amx_off=amx_turned_off(), kept=_calibration_file)


def aten_cpu_path(dtype: torch.dtype) -> str:
    """What aten's CPU flash kernel computes ``dtype`` inputs in here, and on which unit
    (read from this CPU's flags, as :func:`cpu_compute_dtype` decides): bf16 on oneDNN's
    AMX tiles or AVX512-BF16 dot products, else float32 FMAs (AVX-512 or AVX2)."""
    features = detect_cpu_features()
    fma = ("AVX-512" if features.avx512f else "AVX2" if "avx2" in cpu_flags()
           else "no AVX2 or AVX-512")
    name = str(dtype).removeprefix("torch.")
    if cpu_compute_dtype(dtype) == torch.bfloat16:
        unit = "AMX tiles" if features.amx_bf16 else "AVX512-BF16 dot products"
        return f"aten's CPU flash kernel in bf16 (oneDNN brgemm on {unit})"
    if dtype != torch.bfloat16:
        converted = "" if dtype == torch.float32 else f"; {name} converted"
        return f"aten's CPU flash kernel in float32 ({fma} FMAs{converted})"
    why = (f"{AMX_ENV}=0 keeps bf16 off oneDNN's AMX tiles" if amx_held_off()
           else "this CPU has no AVX512-BF16 or AMX")
    return f"aten's CPU flash kernel in float32 ({fma} FMAs; bf16 converted: {why})"


#: The class's old name (deprecated alias: its name now says its kind).
TorchSDPABackend = TorchSDPAPrefillBackend
