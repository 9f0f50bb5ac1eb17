"""Merging two partial attention results by their log-sum-exp (natural log).

Attention over the union of two disjoint key sets is the LSE-weighted mix of the attention over
each set: with ``m = max(lse_a, lse_b)``, ``w_a = exp(lse_a - m)``, ``w_b = exp(lse_b - m)``,
``out = (w_a * out_a + w_b * out_b) / (w_a + w_b)`` and ``lse = m + log(w_a + w_b)``. A row
whose LSE is ``-inf`` on one side (an empty context chunk) takes the other side unchanged; a row
that is ``-inf`` on both sides gets out 0 and LSE ``-inf``. No NaN is produced as long as the
outputs are finite (backends write 0 on rows that see no key).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from app.backends.lse import LN2, LOG2E

__all__ = ["merge_attn_states"]

#: Base-2 LSE floor handed to flashinfer instead of -inf (its kernel would compute -inf - -inf).
_FLOOR = -1.0e30
_FLASHINFER_HEAD_DIMS = (64, 128, 256)


@functools.cache
def _flashinfer() -> ModuleType | None:
    try:
        import flashinfer
    except Exception:  # any import-time failure means "not available"
        return None
    return flashinfer if hasattr(flashinfer, "merge_state_in_place") else None


def _check(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
           suffix_lse: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, t in (("prefix_out", prefix_out), ("prefix_lse", prefix_lse),
                    ("suffix_out", suffix_out), ("suffix_lse", suffix_lse), ("out", out)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"merge_attn_states: {name} must be a torch.Tensor, "
                            f"got {type(t).__name__}")
    if prefix_out.dim() != 3:
        raise ValueError(f"merge_attn_states: prefix_out must be [T, H, D], got shape "
                         f"{list(prefix_out.shape)}")
    tokens, heads, _ = prefix_out.shape
    if suffix_out.shape != prefix_out.shape:
        raise ValueError(f"merge_attn_states: suffix_out shape: expected "
                         f"{list(prefix_out.shape)} (as prefix_out), got {list(suffix_out.shape)}")
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        if list(lse.shape) != [heads, tokens]:
            raise ValueError(f"merge_attn_states: {name} shape: expected [{heads}, {tokens}] "
                             f"([H, T]), got {list(lse.shape)}")
        if not lse.is_floating_point():
            raise ValueError(f"merge_attn_states: {name} must be floating point, got {lse.dtype}")
    if not prefix_out.is_floating_point() or suffix_out.dtype != prefix_out.dtype:
        raise ValueError(f"merge_attn_states: outputs must share a floating dtype, got "
                         f"{prefix_out.dtype} and {suffix_out.dtype}")
    devices = {t.device for t in (prefix_out, prefix_lse, suffix_out, suffix_lse)}
    if out is not None:
        if out.shape != prefix_out.shape or not out.is_floating_point():
            raise ValueError(f"merge_attn_states: out: expected a floating tensor of shape "
                             f"{list(prefix_out.shape)}, got {list(out.shape)} {out.dtype}")
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"merge_attn_states: expected every tensor on one device, got "
                         f"{sorted(str(d) for d in devices)}")


def _merge_torch(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                 suffix_lse: torch.Tensor, out: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    lse_a = prefix_lse.float()
    lse_b = suffix_lse.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)  # log(0) = -inf: a row empty on both sides stays -inf
    inv = torch.where(total > 0, total.reciprocal(), torch.zeros_like(total))
    scale_a = (w_a * inv).t().unsqueeze(-1)
    scale_b = (w_b * inv).t().unsqueeze(-1)
    merged = prefix_out.float() * scale_a
    merged.addcmul_(suffix_out.float(), scale_b)
    if out is None:
        return merged.to(prefix_out.dtype), lse
    out.copy_(merged)
    return out, lse


def _can_use_flashinfer(prefix_out: torch.Tensor, suffix_out: torch.Tensor,
                        out: torch.Tensor | None) -> bool:
    return (prefix_out.is_cuda and prefix_out.dtype in (torch.float16, torch.bfloat16)
            and prefix_out.shape[-1] in _FLASHINFER_HEAD_DIMS
            and (out is None or (out.dtype == prefix_out.dtype and out.is_contiguous()))
            and _flashinfer() is not None)


def _merge_flashinfer(prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_out: torch.Tensor, suffix_lse: torch.Tensor,
                      out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashinfer.merge_state_in_place`` on base-2, fp32, ``[T, H]`` LSE (untested on GPU
    here: it needs flashinfer's JIT-built ``cascade`` module)."""
    module = _flashinfer()
    if module is None:  # pragma: no cover - guarded by _can_use_flashinfer
        raise RuntimeError("flashinfer is not available")
    if out is not None and out.data_ptr() == suffix_out.data_ptr():
        # Merging is symmetric: accumulate into the buffer that already holds suffix_out.
        prefix_out, suffix_out = suffix_out, prefix_out
        prefix_lse, suffix_lse = suffix_lse, prefix_lse
    target = out if out is not None else torch.empty_like(prefix_out)
    if target.data_ptr() != prefix_out.data_ptr():
        target.copy_(prefix_out)
    s = (prefix_lse.float().t() * LOG2E).clamp_min(_FLOOR).contiguous()
    s_other = (suffix_lse.float().t() * LOG2E).clamp_min(_FLOOR).contiguous()
    other = suffix_out if suffix_out.is_contiguous() else suffix_out.contiguous()
    module.merge_state_in_place(target, s, other, s_other)
    lse = torch.where(s.t() <= _FLOOR / 2, torch.full_like(s.t(), float("-inf")),
                      s.t() * LN2).contiguous()
    return target, lse


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_out: torch.Tensor, suffix_lse: torch.Tensor,
                      out: torch.Tensor | None = None, *, use_flashinfer: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets.

    ``*_out: [T, H, D]`` (one dtype), ``*_lse: [H, T]`` natural log (``-inf`` = no key).
    Returns ``(out [T, H, D], lse [H, T] float32)``; ``out`` (any floating dtype, may alias
    either input) receives the result when given, else a new tensor of the inputs' dtype.

    ``use_flashinfer``: None (default) uses ``flashinfer.merge_state_in_place`` for fp16/bf16
    CUDA tensors with a head dim it supports when flashinfer imports, decided from those facts
    alone (a kernel error, out of memory included, propagates: nothing switches paths for
    good); False always uses the torch implementation; True requires flashinfer.
    """
    _check(prefix_out, prefix_lse, suffix_out, suffix_lse, out)
    usable = _can_use_flashinfer(prefix_out, suffix_out, out)
    if use_flashinfer is True and not usable:
        raise ValueError("merge_attn_states: use_flashinfer=True needs flashinfer and fp16/bf16 "
                         f"CUDA tensors with head dim in {_FLASHINFER_HEAD_DIMS}")
    if use_flashinfer is not False and usable:
        return _merge_flashinfer(prefix_out, prefix_lse, suffix_out, suffix_lse, out)
    return _merge_torch(prefix_out, prefix_lse, suffix_out, suffix_lse, out)
