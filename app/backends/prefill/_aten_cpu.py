"""TORCH_SDPA's aten CPU paths: where the native kernel cannot run (no AVX-512 or compiler,
bf16 compute on a CPU with fast bf16, ``APP_CPU_NATIVE_KERNEL=0``). bf16 inputs compute in bf16
where the CPU has fast bf16 products and in float32 elsewhere, and on an AMX CPU with
``APP_CPU_AMX=0`` (:func:`cpu_compute_dtype`).

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` returns the natural-log LSE
but needs equal head dims (``v`` is zero-padded to the q/k head dim, the buffer kept between
calls), aligns ``is_causal`` top-left and gives LSE 0 to rows that see no key. So rows that see
no key never reach it (out 0, LSE ``-inf``); a short float32 causal call runs as plain
matmuls in blocks of ``blocked_rows`` query rows over only the keys they see; other short
causal calls run in chunks of ``causal_chunk`` rows with a small bottom-right mask; a long
causal call is one ``is_causal`` call over the square, merged by LSE with the extra leading
keys. Why each threshold has its value: docs/benchmarks.md.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from app._cpu import cpu_has_native_bf16, detect_cpu_features
from app.backends.cpu.amx import amx_turned_off
from app.backends.merge import merge_attn_states
from app.backends.prefill.kernel_base import RaggedLayout

__all__ = ["AtenCpuPrefill", "amx_held_off", "cpu_compute_dtype"]

_NEG_INF = float("-inf")
_MASK_CACHE_SIZE = 256
_EXP_FLOOR = -80.0
#: Heads per matmul batch of the plain-matmul path (its score tile is heads x rows x keys).
_BLOCKED_HEADS = 16
#: Largest zero-padded v buffer (bytes) kept between calls (its padding stays zero).
_V_BUFFER_MAX_BYTES = 256 << 20


def amx_held_off() -> bool:
    """The CPU has AMX tiles and ``APP_CPU_AMX=0`` keeps them off: aten's bf16 kernel would
    run its blocks on them (oneDNN's brgemm), so it computes in float32 instead."""
    return detect_cpu_features().amx_bf16 and amx_turned_off()


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU kernel computes in for ``dtype`` inputs: bf16 only where the CPU has
    fast bf16 matmuls (AMX / AVX512-BF16) that may be used (not on an AMX CPU with
    ``APP_CPU_AMX=0``: :func:`amx_held_off`), float32 otherwise (and always for fp16)."""
    if dtype == torch.bfloat16 and cpu_has_native_bf16() and not amx_held_off():
        return torch.bfloat16
    if dtype == torch.float64:
        return torch.float64
    return torch.float32


def _batch_view(x: torch.Tensor, start: int, count: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + count * length)`` of ``x [T, H, D]`` as ``[count, H, length, D]``
    (a strided view)."""
    _, heads, dim = x.shape
    return x[start:start + count * length].view(count, length, heads, dim).transpose(1, 2)


class AtenCpuPrefill:
    """The aten CPU paths of one TORCH_SDPA backend: its mask caches (shared under a lock;
    masks are read-only) and its padded-v buffer (one per thread, written per call)."""

    def __init__(self, num_heads: int, qk_head_dim: int, v_head_dim: int, scale: float, *,
                 causal_chunk: int, chunked_causal_max: int, blocked_rows: int) -> None:
        self.num_heads, self.scale = num_heads, scale
        self.qk_head_dim, self.v_head_dim = qk_head_dim, v_head_dim
        self.causal_chunk = causal_chunk
        self.chunked_causal_max = chunked_causal_max
        self.blocked_rows = blocked_rows
        self._masks: OrderedDict[tuple[int, int, int, torch.dtype], torch.Tensor] = OrderedDict()
        self._keeps: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._cache_lock = threading.Lock()
        self._v_buffers = threading.local()

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

    def _padded_v(self, v: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
        """``v [T, H, Dv]`` zero-padded to ``width`` in ``dtype``; the buffer is kept (and its
        padding left zero) between calls when at most ``_V_BUFFER_MAX_BYTES``, so a call only
        copies ``v`` in (one buffer per thread)."""
        tokens, heads, dim = v.shape
        buf: torch.Tensor | None = getattr(self._v_buffers, "buf", None)
        keep = tokens * heads * width * dtype.itemsize <= _V_BUFFER_MAX_BYTES
        if (buf is None or not keep or buf.dtype != dtype or buf.shape[0] < tokens
                or buf.shape[1] != heads or buf.shape[2] != width):
            buf = torch.zeros(tokens, heads, width, dtype=dtype)
            self._v_buffers.buf = buf if keep else None
        buf = buf[:tokens]
        buf[..., :dim].copy_(v)
        return buf

    def run(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool, result: torch.Tensor, lse: torch.Tensor) -> None:
        """Attention of one call into ``result [T, H, Dv]`` and ``lse [H, T]`` (finite
        inputs: the caller sends non-finite ones to the dense path)."""
        dtype = cpu_compute_dtype(q.dtype)
        width = max(self.qk_head_dim, self.v_head_dim)
        qk = []
        for x in (q, k):
            if x.shape[-1] < width:
                buf = torch.empty(x.shape[0], x.shape[1], width, dtype=dtype)
                buf[..., x.shape[-1]:].zero_()
                buf[..., :x.shape[-1]].copy_(x)
                qk.append(buf)
            else:
                x = x.to(dtype)
                qk.append(x if x.stride(-1) == 1 else x.contiguous())
        runs = layout.runs()
        if causal and all(self._blocked(q_len, kv_len, dtype) for *_, q_len, kv_len in runs):
            vx = v.to(dtype)  # the plain-matmul path needs no padding
        else:
            vx = self._padded_v(v, dtype, width)
        for q0, k0, count, q_len, kv_len in runs:
            if q_len:
                self._cpu_run(
                    _batch_view(qk[0], q0, count, q_len), _batch_view(qk[1], k0, count, kv_len),
                    _batch_view(vx, k0, count, kv_len), result, lse, q0, count, q_len, kv_len,
                    causal)

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
        chunk = self.causal_chunk
        if self._blocked(q_len, kv_len, qb.dtype):
            for i in range(count):
                self._cpu_blocked_causal(qb[i, :, dead:], kb[i], vb[i, :, :, :dv],
                                         res[i, dead:].transpose(0, 1), lse_v[:, i, dead:],
                                         extra)
            return
        if chunk > 0 and rows <= self.chunked_causal_max and (extra or rows > chunk):
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
        return (self.blocked_rows > 0 and dtype == torch.float32
                and 0 < rows <= self.chunked_causal_max)

    def _cpu_blocked_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, extra: int) -> None:
        """One request's causal square in plain float32 matmuls, ``blocked_rows`` query
        rows at a time over only the keys they can see (row ``r`` sees keys ``<= extra + r``).

        ``q: [H, rows, Dqk]``, ``k: [H, extra + rows, Dqk]``, ``v: [H, extra + rows, Dv]``
        (strided views); writes ``out: [H, rows, Dv]`` and ``lse: [H, rows]`` views. Only the
        diagonal tile of each block is masked; the LSE comes from the same max and sum."""
        heads, rows = q.shape[0], q.shape[1]
        group = max(1, min(heads, _BLOCKED_HEADS))
        step = self.blocked_rows
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
                # torch's exp is far slower on inputs that underflow (< -87.3, -inf
                # included): clamp first (weight e^-80 ~ 2e-35 is below float32 resolution
                # next to the row max's 1), then zero the masked keys exactly.
                s.sub_(m).clamp_(min=_EXP_FLOOR).exp_()
                diag.mul_(self._keep(b - a, s.dtype))
                total = torch.sum(s, -1, keepdim=True, out=row_sum[hs, a:b])
                torch.div(torch.bmm(s, v[hs, :end]), total, out=out[hs, a:b])
        torch.add(row_max.squeeze(-1), row_sum.squeeze(-1).log_(), out=lse)
