"""Input checks of the MLA prefill contract, shared by every prefill backend.

A kernel must never be handed a shape it would read out of bounds, so the base's template
(``MLAPrefillBackend.run_prefill_new_tokens`` / ``run_prefill_context_chunk``) calls
``check_attention_inputs`` before every launch: rank, heads, head dims, dtype, device and token
counts matching the step's ``cu_seqlens``, and a caller's ``out=``. Rows that see no key get
out 0 and LSE ``-inf`` whatever the kernel wrote (``zero_empty_rows``).

A subclass that defines the run verbs itself (the old way) gets the same checks around them:

``MLAPrefillBackend.__init_subclass__`` calls ``check_own_verbs``: ``prepare_metadata`` and the
run verbs a class defines itself are wrapped, so the step and input checks and the ``out=`` rule
run before them, and what they return is held to the contract (``out [T, H, Dv]`` of the
backend's output dtype on q's device, the LSE ``[H, T]`` float32 on the same device, rows that
see no key out 0 and LSE ``-inf``; ``TypeError`` naming the verb and what it returned
otherwise), never handed to the caller as it came.

``call_reads`` lists every tensor a prefill kernel reads, for the ``out=`` rule
(``app.backends.contract.writes_in_place``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch

from app._validation import check_dense, check_writable_out
from app.backends.contract import (
    check_return_flag,
    checked_returned_lse,
    describe_value,
    writes_in_place,
)
from app.backends.prefill.metadata import MLAPrefillMetadata, RaggedLayout

__all__ = ["call_reads", "check_attention_inputs", "check_own_verbs", "empty_rows_mask",
           "zero_empty_rows"]


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


# -- a subclass whose run verbs are its own (its ``self``: an ``MLAPrefillBackend``, typed
# ``Any`` because this module sits below the base) ---------------------------------------
_Verb = Callable[..., Any]


def call_reads(layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
    """Every tensor a prefill kernel may read in one call: q, k, v and the step's prefix sums
    (an ``out=`` sharing memory with any is written after the kernel, never during it)."""
    return q, k, v, layout.cu_q, layout.cu_kv, layout.cu_q_cpu, layout.cu_kv_cpu


def check_own_verbs(cls: type[Any], base: Any) -> None:
    """Wrap ``prepare_metadata`` and the run verbs that ``cls`` defines itself in the checks of
    ``base`` (``MLAPrefillBackend``), and make a class whose run verbs are all its own concrete
    (its ``_run_prefill`` is never called)."""
    for name, wrap in (("prepare_metadata", _checked_prepare),
                       ("run_prefill_new_tokens", _checked_new_tokens),
                       ("run_prefill_context_chunk", _checked_context_chunk)):
        own = vars(cls).get(name)
        if callable(own) and not getattr(own, "_app_checked", False):
            checked = wrap(own)
            checked._app_checked = True  # type: ignore[attr-defined]
            type.__setattr__(cls, name, checked)
    if (getattr(cls._run_prefill, "__isabstractmethod__", False)
            and cls.run_prefill_new_tokens is not base.run_prefill_new_tokens
            and cls.run_prefill_context_chunk is not base.run_prefill_context_chunk):
        type.__setattr__(cls, "_run_prefill", _runs_its_own_verbs)


def _runs_its_own_verbs(self: Any, *args: Any) -> None:
    """``_run_prefill`` of a class whose run verbs are its own: never called by them."""
    raise NotImplementedError(f"{type(self).__name__} defines run_prefill_new_tokens and "
                              f"run_prefill_context_chunk itself: its _run_prefill is unused")


def _checked_prepare(own: _Verb) -> _Verb:
    @functools.wraps(own)
    def prepare_metadata(self: Any, prefill_metadata: MLAPrefillMetadata,
                         *args: Any, **kwargs: Any) -> Any:
        self._take_step(prefill_metadata)
        try:
            return own(self, prefill_metadata, *args, **kwargs)
        except BaseException:
            self._metadata = self._layouts = None
            raise
    return prepare_metadata


def _checked_new_tokens(own: _Verb) -> _Verb:
    @functools.wraps(own)
    def run_prefill_new_tokens(self: Any, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, return_softmax_lse: bool,
                               out: torch.Tensor | None = None, *args: Any, **kwargs: Any
                               ) -> Any:
        verb = "run_prefill_new_tokens"
        want = check_return_flag(f"{self._label()}.{verb}", "return_softmax_lse",
                                 return_softmax_lse)
        layout = self._step().new_tokens
        self._check_inputs(layout, q, k, v, out)
        given = out if writes_in_place(out, call_reads(layout, q, k, v)) else None
        result = own(self, q, k, v, return_softmax_lse, given, *args, **kwargs)
        return _own_result(self, verb, layout, True, result, want, out, q)
    return run_prefill_new_tokens


def _checked_context_chunk(own: _Verb) -> _Verb:
    @functools.wraps(own)
    def run_prefill_context_chunk(self: Any, chunk: int, q: torch.Tensor,
                                  k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor | None = None, *args: Any, **kwargs: Any
                                  ) -> Any:
        self.context_chunk(chunk)
        layout = self._step().chunks[chunk]
        self._check_inputs(layout, q, k, v, out)
        given = out if writes_in_place(out, call_reads(layout, q, k, v)) else None
        result = own(self, chunk, q, k, v, given, *args, **kwargs)
        return _own_result(self, "run_prefill_context_chunk", layout, False, result, True, out,
                           q)
    return run_prefill_context_chunk


def _own_result(backend: Any, verb: str, layout: RaggedLayout, causal: bool,
                result: object, want_lse: bool, out: torch.Tensor | None,
                q: torch.Tensor) -> Any:
    """What a subclass's own verb returned, held to the contract (see the module docstring),
    the output copied into the caller's ``out=``."""
    who = f"{backend._label()}.{verb}"
    got, lse = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    want_out = [layout.total_q, backend.num_heads, backend.v_head_dim]
    if not isinstance(got, torch.Tensor) or list(got.shape) != want_out:
        raise TypeError(f"{who} returned {describe_value(result)}; expected out {want_out}"
                        f"{' and lse [H, T]' if want_lse else ''}")
    dtype = backend._out_dtype(q.dtype)
    if got.layout != torch.strided or got.dtype != dtype or got.device != q.device:
        raise TypeError(f"{who} returned out as a {got.dtype} tensor on {got.device} "
                        f"(layout {got.layout}); expected a dense {dtype} tensor on "
                        f"{q.device} (the output dtype for {q.dtype} inputs, on q's device)")
    if want_lse:
        lse = checked_returned_lse(who, result, lse, [backend.num_heads, layout.total_q],
                                   q.device)
    if out is not None and got is not out:
        out.copy_(got)
        got = out
    zero_empty_rows(got, lse, backend._empty_mask(layout, causal, got.device))
    return (got, lse) if want_lse else got

