"""The prefill base's checks around a subclass that defines the run verbs itself (the README's
old way), and what a prefill kernel reads.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from app.backends.contract import check_return_flag, writes_in_place
from app.backends.prefill.checks import zero_empty_rows
from app.backends.prefill.metadata import MLAPrefillMetadata, RaggedLayout

if TYPE_CHECKING:
    from app.backends.prefill.base import MLAPrefillBackend

__all__ = ["call_reads", "check_own_verbs"]

_Verb = Callable[..., Any]


def call_reads(layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
    """Every tensor a prefill kernel may read in one call: q, k, v and the step's prefix sums
    (an ``out=`` sharing memory with any is written after the kernel, never during it)."""
    return q, k, v, layout.cu_q, layout.cu_kv, layout.cu_q_cpu, layout.cu_kv_cpu


def check_own_verbs(cls: type[MLAPrefillBackend], base: Any) -> None:
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


def _runs_its_own_verbs(self: MLAPrefillBackend, *args: Any) -> None:
    """``_run_prefill`` of a class whose run verbs are its own: never called by them."""
    raise NotImplementedError(f"{type(self).__name__} defines run_prefill_new_tokens and "
                              f"run_prefill_context_chunk itself: its _run_prefill is unused")


def _checked_prepare(own: _Verb) -> _Verb:
    @functools.wraps(own)
    def prepare_metadata(self: MLAPrefillBackend, prefill_metadata: MLAPrefillMetadata,
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
    def run_prefill_new_tokens(self: MLAPrefillBackend, q: torch.Tensor, k: torch.Tensor,
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
    def run_prefill_context_chunk(self: MLAPrefillBackend, chunk: int, q: torch.Tensor,
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


def _own_result(backend: MLAPrefillBackend, verb: str, layout: RaggedLayout, causal: bool,
                result: object, want_lse: bool, out: torch.Tensor | None,
                q: torch.Tensor) -> Any:
    """What a subclass's own verb returned, held to the contract (see the module docstring),
    the output copied into the caller's ``out=``."""
    who = f"{backend._label()}.{verb}"
    got, lse = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    want_out = [layout.total_q, backend.num_heads, backend.v_head_dim]
    if not isinstance(got, torch.Tensor) or list(got.shape) != want_out:
        raise TypeError(f"{who} returned {_describe(result)}; expected out {want_out}"
                        f"{' and lse [H, T]' if want_lse else ''}")
    dtype = backend._out_dtype(q.dtype)
    if got.layout != torch.strided or got.dtype != dtype or got.device != q.device:
        raise TypeError(f"{who} returned out as a {got.dtype} tensor on {got.device} "
                        f"(layout {got.layout}); expected a dense {dtype} tensor on "
                        f"{q.device} (the output dtype for {q.dtype} inputs, on q's device)")
    if want_lse:
        want_lse_shape = [backend.num_heads, layout.total_q]
        if not isinstance(lse, torch.Tensor) or list(lse.shape) != want_lse_shape \
                or lse.dtype != torch.float32 or lse.layout != torch.strided \
                or lse.device != q.device:
            raise TypeError(f"{who} returned {_describe(result)}; expected (out, lse) with "
                            f"lse {want_lse_shape} float32 on {q.device} (natural log, "
                            f"head-major)")
        lse = lse.contiguous()
    if out is not None and got is not out:
        out.copy_(got)
        got = out
    zero_empty_rows(got, lse, backend._empty_mask(layout, causal, got.device))
    return (got, lse) if want_lse else got


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {list(value.shape)} on {value.device}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__
