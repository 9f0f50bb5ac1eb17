"""Input checks of the MLA prefill contract, shared by every prefill backend.

A kernel must never be handed a shape it would read out of bounds, so the base's template
(``MLAPrefillBackend.run_prefill_new_tokens`` / ``run_prefill_context_chunk``) calls
``check_attention_inputs`` before every launch: rank, heads, head dims, dtype, device and token
counts matching the step's ``cu_seqlens``, and a caller's ``out=``. Rows that see no key get
out 0 and LSE ``-inf`` whatever the kernel wrote (``zero_empty_rows``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch

from app._validation import check_dense, check_writable_out

__all__ = ["check_attention_inputs", "empty_rows_mask", "zero_empty_rows"]


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check_attention_inputs(who: str, q: object, k: object, v: object, *, num_heads: int,
                           qk_head_dim: int, v_head_dim: int, total_q: int, total_kv: int,
                           dtypes: Iterable[torch.dtype], device: torch.device | None = None,
                           out: object = None, out_dtype: torch.dtype | None = None,
                           out_contiguous: bool = False) -> None:
    """Check ``q [total_q, H, qk]``, ``k [total_kv, H, qk]``, ``v [total_kv, H, v]`` (and
    ``out [total_q, H, v]``) before a launch; ``ValueError`` names expected vs actual
    (``TypeError`` for an argument that is not a tensor).

    ``device``: where the kernel runs (the device of the ``cu_seqlens``), when it matters.
    """
    allowed = dtypes if isinstance(dtypes, (tuple, list, set, frozenset)) else tuple(dtypes)
    if out is None and _inputs_pass(q, k, v, (total_q, num_heads, qk_head_dim),
                                    (total_kv, num_heads, qk_head_dim),
                                    (total_kv, num_heads, v_head_dim), allowed, device):
        return  # every check below passes: the common call costs a few comparisons
    tensors: dict[str, torch.Tensor] = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(f"{who}: {name}", t)
        if t.dim() != 3:
            raise ValueError(f"{who}: {name} must have rank 3 [tokens, heads, head_dim], got "
                             f"rank {t.dim()} (shape {_shape(t)})")
        tensors[name] = t
    expected = {"q": (total_q, num_heads, qk_head_dim), "k": (total_kv, num_heads, qk_head_dim),
                "v": (total_kv, num_heads, v_head_dim)}
    labels = ("tokens", "heads", "head dim")
    for name, t in tensors.items():
        for axis, (want, got) in enumerate(zip(expected[name], t.shape, strict=True)):
            if want != got:
                raise ValueError(f"{who}: {name} {labels[axis]} (dim {axis}): expected {want}, "
                                 f"got {got} (shape {_shape(t)}, expected {list(expected[name])})")
    qt = tensors["q"]
    if qt.dtype not in allowed:
        raise ValueError(f"{who}: q dtype: expected one of {[str(d) for d in allowed]}, "
                         f"got {qt.dtype}")
    for name in ("k", "v"):
        if tensors[name].dtype != qt.dtype:
            raise ValueError(f"{who}: {name} dtype: expected {qt.dtype} (as q), got "
                             f"{tensors[name].dtype}")
        if tensors[name].device != qt.device:
            raise ValueError(f"{who}: {name} device: expected {qt.device} (as q), got "
                             f"{tensors[name].device}")
    if device is not None and qt.device != device:
        raise ValueError(f"{who}: q device: expected {device} (where the cu_seqlens live), "
                         f"got {qt.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{who}: out must be a torch.Tensor, got {type(out).__name__}")
        want_shape = [total_q, num_heads, v_head_dim]
        if _shape(out) != want_shape:
            raise ValueError(f"{who}: out shape: expected {want_shape}, got {_shape(out)}")
        want_dtype = qt.dtype if out_dtype is None else out_dtype
        if out.dtype != want_dtype:
            raise ValueError(f"{who}: out dtype: expected {want_dtype}, got {out.dtype}")
        if out.device != qt.device:
            raise ValueError(f"{who}: out device: expected {qt.device}, got {out.device}")
        if out_contiguous and not out.is_contiguous():
            raise ValueError(f"{who}: out must be contiguous, got strides {list(out.stride())}")
        check_writable_out(f"{who}: out", out)


def _inputs_pass(q: object, k: object, v: object, q_shape: tuple[int, int, int],
                 k_shape: tuple[int, int, int], v_shape: tuple[int, int, int],
                 dtypes: Collection[torch.dtype], device: torch.device | None) -> bool:
    """Whether ``check_attention_inputs`` (without ``out``) would pass, in one expression:
    True only where each of its checks holds; anything else goes through them for the
    message."""
    tensor, strided = torch.Tensor, torch.strided
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)):
        return False
    dtype, where = q.dtype, q.device
    return (q.shape == q_shape and k.shape == k_shape and v.shape == v_shape
            and dtype in dtypes and k.dtype == dtype and v.dtype == dtype
            and k.device == where and v.device == where
            and (device is None or where == device) and where.type != "meta"
            and q.layout == strided and k.layout == strided and v.layout == strided)


def empty_rows_mask(ranges: Sequence[tuple[int, int]], total_q: int,
                    device: torch.device) -> torch.Tensor | None:
    """A bool ``[total_q]`` mask of the rows in ``ranges`` (None when there are none), built
    on the host and copied once: used to give rows that see no key out 0 and LSE -inf."""
    if not ranges:
        return None
    mask = torch.zeros(total_q, dtype=torch.bool)
    for start, stop in ranges:
        mask[start:stop] = True
    return mask.to(device, non_blocking=True)


def zero_empty_rows(out: torch.Tensor, lse: torch.Tensor | None,
                    mask: torch.Tensor | None) -> None:
    """Out 0 and LSE ``-inf`` (``lse [H, T]``) on the rows of ``mask``, in place."""
    if mask is None:
        return
    out.masked_fill_(mask.view(-1, 1, 1), 0.0)
    if lse is not None:
        lse.masked_fill_(mask.view(1, -1), float("-inf"))
