"""TORCH_SDPA: MLA prefill on torch's own fused attention kernels; runs everywhere.

**CPU with AVX-512 and a C compiler** (the default there): the native
kernel of :mod:`app.backends._cpu_native` (``_native/mla_prefill_cpu.c``, built at first use;
``cpu_native_kernel = False`` or ``APP_CPU_NATIVE_KERNEL=0`` turns it off). No padded ``v``,
only the causal diagonal's 14 x 32 tiles are masked, bottom-right causal and empty rows
handled in the kernel; fp16 (and bf16 on CPUs without AVX512-BF16) are converted while packing
(float32 math). bf16 inputs on a CPU with AVX512-BF16 take the kernel's bf16-products build
(:mod:`app.backends._cpu_native_bf16`: q.k and p.v through ``vdpbf16ps``, float32 accumulation,
probabilities rounded to bf16). Measured on a 2-core AVX-512 machine: 0.76-0.84 of the fp32
matmul rate on 1 x 4096 causal (aten's: ~0.55); against the measured peaks, see
docs/benchmarks.md.

**CPU otherwise**: the aten CPU flash kernel
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which returns the natural-log
LSE. It needs equal head dims, so ``v`` is zero-padded to the q/k head dim (the LSE does not
depend on ``v``; the padded buffer is kept between calls, so only ``v`` is copied in) and the
output sliced back. It computes in float32 unless the CPU has fast bf16 (AMX / AVX512-BF16),
and takes strided ``[n, H, L, D]`` views of the ``[T, H, D]`` inputs (no layout copy;
``cpu_head_major`` copies to ``[H, T, D]`` instead, which measured no faster). Consecutive
requests with equal lengths run as one batched call. The kernel's ``is_causal`` is top-left
aligned and it gives LSE 0 to rows that see no key, so:

- rows that see no key (``q_len > kv_len`` under the bottom-right causal mask, or no keys at
  all) are never handed to the kernel; they get out 0 and LSE ``-inf``;
- a short causal float32 call (at most ``cpu_chunked_causal_max`` rows that see a key) runs
  per request as plain float32 matmuls, ``cpu_blocked_rows`` query rows at a time over only
  the keys they can see (no padded v, no masked work outside the diagonal tiles; exp inputs
  clamped at -80, since torch's exp is ~50x slower on inputs that underflow); measured
  ~1.15-1.25x the chunked kernel calls below on 4 x 512 (2-core AVX512); it lost on 1 x 4096;
- otherwise a short causal call (at most ``cpu_chunked_causal_max`` query rows, or any call
  with more keys than queries up to that size) runs as chunks of ``cpu_causal_chunk`` query
  rows, each over the keys it can see with a small bottom-right additive mask: the kernel
  skips no work inside a 512-key block, so one ``is_causal`` call would do the full square;
- a long causal call runs as one ``is_causal`` call over the square part, merged by LSE with
  a non-causal call over the extra leading keys when ``kv_len > q_len``.

Measured limits of this kernel on a 2-core AVX512 machine (see docs/gpu-results.md and the
benchmark): the zero-padded v costs 1/6 of the FLOPs (192 instead of 128 columns in P @ V),
a long causal call does ~12% extra work (kv blocks of 512), and 32/64-row query blocks of
short calls run well below the kernel's large-block rate.

**CUDA**: torch's varlen flash kernel (``aten::_flash_attention_forward``, v padded to the
q/k head dim, fp16/bf16, head dim <= 256), else the varlen memory-efficient kernel
(``aten::_efficient_attention_forward``, bottom-right causal mask type), else a per-request float32
matmul-softmax-matmul: ``cuda_kernel`` decides from the device capability passed in at construction
and the head dims; a kernel's run-time error (out of memory included) propagates. Not run on a GPU
in this project's CI; see docs/gpu-results.md.

No path syncs with the device per request: lengths come from the host copies of the
``cu_seqlens`` read once in ``prepare_metadata``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar

import torch

from app._cpu import cpu_has_native_bf16
from app._types import DeviceCapability
from app.backends._cpu_native import (
    V_HEAD_DIM_MULTIPLE,
    NativeMLAPrefillKernel,
    NativePlan,
    load_native_kernel,
)
from app.backends._cpu_native_bf16 import load_native_bf16_kernel
from app.backends._dense import all_finite, attend_dense
from app.backends.kernel_base import RaggedKernelBackend, RaggedLayout, unit_stride
from app.backends.merge import merge_attn_states

if TYPE_CHECKING:
    from app.backends.kernel_base import KernelWorkspaces
    from app.config import EngineConfig

__all__ = ["TorchSDPABackend", "cpu_compute_dtype"]

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")
_MASK_CACHE_SIZE = 256
_EXP_FLOOR = -80.0


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU kernel computes in for ``dtype`` inputs: bf16 only where the CPU has
    fast bf16 matmuls (AMX / AVX512-BF16), float32 otherwise (and always for fp16)."""
    if dtype == torch.bfloat16 and cpu_has_native_bf16():
        return torch.bfloat16
    if dtype == torch.float64:
        return torch.float64
    return torch.float32


def _batch_view(x: torch.Tensor, start: int, count: int, length: int, head_major: bool
                ) -> torch.Tensor:
    """Rows ``[start, start + count * length)`` of ``x`` as ``[count, H, length, D]``."""
    if head_major:  # x is [H, T, D]
        heads, _, dim = x.shape
        return x[:, start:start + count * length].view(heads, count, length, dim).transpose(0, 1)
    _, heads, dim = x.shape  # x is [T, H, D]
    return x[start:start + count * length].view(count, length, heads, dim).transpose(1, 2)


class TorchSDPABackend(RaggedKernelBackend):
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
    #: Query rows per chunk of a short causal call on CPU (0: never chunk). Measured on a
    #: 2-core AVX512 machine: 64..256 are within noise on 4 x 512; 256 keeps the kernel's
    #: 64-row query blocks (shorter calls get 32-row blocks, which pack K more often).
    cpu_causal_chunk: ClassVar[int] = 256
    #: Causal calls with at most this many query rows (after dropping rows that see no key)
    #: run in chunks on CPU; longer ones run as one ``is_causal`` call (from 768 rows the
    #: kernel uses 256-row query blocks, and one call wins: 1 x 2048 is ~20% faster).
    cpu_chunked_causal_max: ClassVar[int] = 768
    #: Query rows per block of the plain-matmul path for short causal calls on CPU in float32
    #: (0: use the aten kernel's chunks instead); keys past a block's last row are skipped.
    cpu_blocked_rows: ClassVar[int] = 64
    #: Heads per matmul batch of that path (the score tile is heads x rows x keys floats).
    cpu_blocked_heads: ClassVar[int] = 16
    #: Copy q/k/v into a head-major ``[H, T, D]`` layout on CPU (every (request, head) block
    #: contiguous) instead of handing the kernel strided views of ``[T, H, D]``.
    cpu_head_major: ClassVar[bool] = False
    #: Largest zero-padded v buffer (bytes) kept between calls (its padding stays zero).
    cpu_v_buffer_max_bytes: ClassVar[int] = 256 << 20

    @staticmethod
    def get_name() -> str:
        """``"TORCH_SDPA"``."""
        return "TORCH_SDPA"

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, config, device_capability=device_capability,
                         workspaces=workspaces)
        self._masks: OrderedDict[tuple[int, int, int, torch.dtype], torch.Tensor] = OrderedDict()
        self._keeps: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # Calls may run on several threads at once (layers of one step): the mask caches
        # are shared under a lock (masks are read-only), the v buffer is written per call,
        # so each thread keeps its own.
        self._cache_lock = threading.Lock()
        self._v_buffers = threading.local()
        self._native: NativeMLAPrefillKernel | bool | None = False  # False: not looked up
        self._native_bf16: NativeMLAPrefillKernel | bool | None = False

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

    def _mask(self, rows: int, keys: int, diagonal: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[rows, keys]`` mask: row r sees keys ``j <= diagonal + r``."""
        key = (rows, keys, diagonal, dtype)
        with self._cache_lock:
            mask = self._masks.get(key)
            if mask is None:
                hidden = torch.ones(rows, keys, dtype=torch.bool).triu(diagonal + 1)
                mask = torch.zeros(rows, keys, dtype=dtype).masked_fill_(hidden, _NEG_INF)
                self._masks[key] = mask
                if len(self._masks) > _MASK_CACHE_SIZE:
                    self._masks.popitem(last=False)
            else:
                self._masks.move_to_end(key)
            return mask

    def _keep(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, rows]`` lower-triangular 0/1 multiplier (row r keeps keys ``j <= r``)."""
        key = (rows, dtype)
        with self._cache_lock:
            keep = self._keeps.get(key)
            if keep is None:
                keep = torch.ones(rows, rows, dtype=dtype).tril_()
                self._keeps[key] = keep
                if len(self._keeps) > _MASK_CACHE_SIZE:
                    self._keeps.pop(next(iter(self._keeps)))
            return keep

    def _padded_v(self, v: torch.Tensor, dtype: torch.dtype, width: int, head_major: bool
                  ) -> torch.Tensor:
        """``v`` zero-padded to ``width`` in ``dtype``; the buffer is kept (and its padding
        left zero) between calls when small enough, so a call only copies ``v`` in (one
        buffer per thread)."""
        tokens, heads, dim = v.shape
        shape = (heads, tokens, width) if head_major else (tokens, heads, width)
        buf: torch.Tensor | None = getattr(self._v_buffers, "buf", None)
        keep = tokens * heads * width * torch.empty((), dtype=dtype).element_size() \
            <= self.cpu_v_buffer_max_bytes
        axis = 1 if head_major else 0
        if (buf is None or not keep or buf.dtype != dtype or buf.shape[axis] < tokens
                or buf.shape[1 - axis] != shape[1 - axis] or buf.shape[2] != width):
            buf = torch.zeros(shape, dtype=dtype)
            self._v_buffers.buf = buf if keep else None
        buf = buf[:, :tokens] if head_major else buf[:tokens]
        buf[..., :dim].copy_(v.transpose(0, 1) if head_major else v)
        return buf

    def _native_kernel(self, dtype: torch.dtype) -> NativeMLAPrefillKernel | None:
        """The native kernel if this call can use it (looked up once per instance)."""
        # Every input dtype the kernel reads; bf16 on the bf16-products build where the CPU
        # has AVX512-BF16 (measured ~1.8x the float32 math on 1 x 4096), else float32 math
        # (which still beat aten's bf16 flash kernel).
        if not self.cpu_native_kernel or self.v_head_dim % V_HEAD_DIM_MULTIPLE:
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

        key = (id(layout), "native-plan")  # one plan per step, shared by every layer
        plan = self._device_cache.get(key)
        if not isinstance(plan, NativePlan):
            plan = kernel.plan(layout.q_starts, layout.q_lens, layout.kv_starts,
                               layout.kv_lens, total_q=layout.total_q,
                               total_kv=layout.total_kv, num_heads=self.num_heads,
                               head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim)
            self._device_cache[key] = plan
        kernel.run(plan, unit_last(q), unit_last(k), unit_last(v), causal, self.scale, result,
                   lse)

    def _run_cpu(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool, result: torch.Tensor, lse: torch.Tensor) -> None:
        native = self._native_kernel(q.dtype)
        if native is not None:
            self._run_cpu_native(native, layout, q, k, v, causal, result, lse)
            return
        if not all_finite(k, v):
            # A NaN or inf in a key or value: the aten kernel would leak it from masked keys
            # (score + -inf, 0 * NaN) into every row; the dense path keeps to the rule (see
            # app.backends._dense). Corrupt input is rare, so its speed does not matter.
            self._run_dense(layout, q, k, v, causal, result, lse)
            return
        dtype = cpu_compute_dtype(q.dtype)
        width = max(self.qk_head_dim, self.v_head_dim)
        head_major = self.cpu_head_major
        qk = []
        for x in (q, k):
            if head_major or x.shape[-1] < width:
                buf = torch.empty((x.shape[1], x.shape[0], width) if head_major
                                  else (x.shape[0], x.shape[1], width), dtype=dtype)
                buf[..., x.shape[-1]:].zero_()
                buf[..., :x.shape[-1]].copy_(x.transpose(0, 1) if head_major else x)
                qk.append(buf)
            else:
                x = x.to(dtype)
                qk.append(x if x.stride(-1) == 1 else x.contiguous())
        runs = layout.runs()
        if causal and not head_major and all(
                self._blocked(q_len, kv_len, dtype) for *_, q_len, kv_len in runs):
            vx = v.to(dtype)  # the plain-matmul path needs no padding
        else:
            vx = self._padded_v(v, dtype, width, head_major)
        for q0, k0, count, q_len, kv_len in runs:
            if q_len:
                self._cpu_run(
                    _batch_view(qk[0], q0, count, q_len, head_major),
                    _batch_view(qk[1], k0, count, kv_len, head_major),
                    _batch_view(vx, k0, count, kv_len, head_major),
                    result, lse, q0, count, q_len, kv_len, causal)

    def _cpu_run(self, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                 result: torch.Tensor, lse: torch.Tensor, q0: int, count: int, q_len: int,
                 kv_len: int, causal: bool) -> None:
        """One dense batch of ``count`` requests with equal lengths (``[n, H, L, D]`` views)."""
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        heads, dv, scale = self.num_heads, self.v_head_dim, self.scale
        width = qb.shape[-1]
        res = result[q0:q0 + count * q_len].view(count, q_len, heads, dv)
        lse_v = lse[:, q0:q0 + count * q_len].view(heads, count, q_len)

        def emit(start: int, stop: int, o: torch.Tensor, lg: torch.Tensor) -> None:
            res[:, start:stop].copy_(o[..., :dv].transpose(1, 2))
            lse_v[:, :, start:stop].copy_(lg.transpose(0, 1))

        dead = q_len if kv_len == 0 else (max(0, q_len - kv_len) if causal else 0)
        if dead:
            res[:, :dead].zero_()
            lse_v[:, :, :dead].fill_(_NEG_INF)
        if dead == q_len:
            return
        if not causal:
            o, lg = op(qb, kb, vb, 0.0, False, scale=scale)
            emit(0, q_len, o, lg)
            return
        rows = q_len - dead          # rows [dead, q_len) form a causal square ...
        extra = kv_len - rows        # ... over keys [extra, kv_len), after `extra` visible keys
        chunk = self.cpu_causal_chunk
        if self._blocked(q_len, kv_len, qb.dtype):
            for i in range(count):
                self._cpu_blocked_causal(qb[i, :, dead:], kb[i], vb[i, :, :, :dv],
                                         res[i, dead:].transpose(0, 1), lse_v[:, i, dead:],
                                         extra)
            return
        if chunk > 0 and rows <= self.cpu_chunked_causal_max and (extra or rows > chunk):
            for a in range(0, rows, chunk):
                b = min(rows, a + chunk)
                keys = extra + b
                mask = self._mask(b - a, keys, extra + a, qb.dtype)
                o, lg = op(qb[:, :, dead + a:dead + b], kb[:, :, :keys], vb[:, :, :keys], 0.0,
                           False, attn_mask=mask, scale=scale)
                emit(dead + a, dead + b, o, lg)
            return
        qs = qb[:, :, dead:]
        o, lg = op(qs, kb[:, :, extra:], vb[:, :, extra:], 0.0, True, scale=scale)
        if extra:
            o2, lg2 = op(qs, kb[:, :, :extra], vb[:, :, :extra], 0.0, False, scale=scale)
            # Kernel outputs are [n, H, rows, D] views of [n, rows, H, D] memory.
            flat = (count * rows, heads, width)
            merged, lse_m = merge_attn_states(
                o.transpose(1, 2).reshape(flat), lg.permute(1, 0, 2).reshape(heads, -1),
                o2.transpose(1, 2).reshape(flat), lg2.permute(1, 0, 2).reshape(heads, -1),
                use_flashinfer=False)
            o = merged.view(count, rows, heads, width).transpose(1, 2)
            lg = lse_m.view(heads, count, rows).transpose(0, 1)
        emit(dead, q_len, o, lg)

    def _blocked(self, q_len: int, kv_len: int, dtype: torch.dtype) -> bool:
        """Whether a causal run of these lengths takes the plain-matmul path."""
        rows = min(q_len, kv_len)
        return (self.cpu_blocked_rows > 0 and dtype == torch.float32
                and 0 < rows <= self.cpu_chunked_causal_max)

    def _cpu_blocked_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, extra: int) -> None:
        """One request's causal square in plain float32 matmuls, ``cpu_blocked_rows`` query
        rows at a time over only the keys they can see (row ``r`` sees keys ``<= extra + r``).

        ``q: [H, rows, Dqk]``, ``k: [H, extra + rows, Dqk]``, ``v: [H, extra + rows, Dv]``
        (strided views); writes ``out: [H, rows, Dv]`` and ``lse: [H, rows]`` views. Only the
        diagonal tile of each block is masked; the LSE comes from the same max and sum."""
        heads, rows = q.shape[0], q.shape[1]
        group = max(1, min(heads, self.cpu_blocked_heads))
        step = self.cpu_blocked_rows
        zero = torch.zeros(1, 1, 1, dtype=q.dtype)
        row_max = torch.empty(heads, rows, 1, dtype=q.dtype)
        row_sum = torch.empty(heads, rows, 1, dtype=q.dtype)
        for h in range(0, heads, group):
            hs = slice(h, h + group)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                end = extra + b
                s = torch.baddbmm(zero, q[hs, a:b], k[hs, :end].transpose(1, 2), beta=0.0,
                                  alpha=self.scale)
                diag = s[:, :, extra + a:end]
                diag += self._mask(b - a, b - a, 0, s.dtype)
                m = torch.amax(s, -1, keepdim=True, out=row_max[hs, a:b])
                # torch's exp is ~50x slower on inputs that underflow (< -87.3, -inf
                # included): clamp first (weight e^-80 ~ 2e-35 is below float32 resolution
                # next to the row max's 1), then zero the masked keys exactly.
                s.sub_(m).clamp_(min=_EXP_FLOOR).exp_()
                diag.mul_(self._keep(b - a, s.dtype))
                total = torch.sum(s, -1, keepdim=True, out=row_sum[hs, a:b])
                torch.div(torch.bmm(s, v[hs, :end]), total, out=out[hs, a:b])
        torch.add(row_max.squeeze(-1), row_sum.squeeze(-1).log_(), out=lse)

    # -- generic per-request fallback -----------------------------------------------------

    def _run_dense(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, causal: bool, result: torch.Tensor, lse: torch.Tensor
                   ) -> None:
        """Per-request float32 matmul-softmax-matmul (lengths from the host layout), NaN
        and inf handled by the rule of :mod:`app.backends._dense`."""
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
        """The path ``cuda_kernel`` picks; a kernel's error (out of memory included)
        propagates to the caller."""
        dqk, dv = self.qk_head_dim, self.v_head_dim
        q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
        kernel = self.cuda_kernel(q.dtype)
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
        else:
            self._run_dense(layout, q, k, v, causal, result, lse)
