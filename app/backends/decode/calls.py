"""One decode call checked (``DecodeCall``), and the decode base's checks around a subclass that
defines ``run_decode`` / ``run_sparse_decode`` itself.

``DecodeCall.check`` is every check of ``MLADecodeBackend``'s verbs: the step, the scales, the
tensors against the step (``check_decode_inputs``) and, for a sparse call, the indices (a
private checked copy: what the kernel reads). ``DecodeCall.reads`` lists every tensor a kernel
may read (q, the cache, the step's block tables and lengths, the indices): an ``out=`` sharing
memory with any of them is written after the kernel, never during it (one sharing memory with
the step's metadata is refused: it would corrupt the step's later calls).

``MLADecodeBackend.__init_subclass__`` calls ``check_own_verbs``: a run verb a class defines
itself is wrapped, so the same checks and the ``out=`` rule run before it, and what it returns
is held to the contract (``out [B, query_len, H, kv_lora_rank]`` of q's dtype on q's device,
the LSE ``[H, B, query_len]`` float32 on the same device; ``TypeError`` naming the verb and what
it returned otherwise), as the prefill base does. A class whose verb is its own need not
implement the kernel hook that verb would call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from app._validation import FLOAT32_MAX, FLOAT32_TINY, MAX_ATTENTION_SCALE
from app.backends.contract import (
    check_attention_scale,
    check_out_spares_step,
    check_return_flag,
    checked_returned_lse,
    describe_value,
    writes_in_place,
)
from app.backends.decode.checks import check_decode_inputs
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.sparse.checks import check_sparse_indices

# The backend is typed ``Any`` here: it is an ``MLADecodeBackend``, whose module imports this
# one (importing it back, even for types only, would be a cycle).

__all__ = ["DecodeCall", "check_own_verbs"]

_Verb = Callable[..., Any]


@attrs.frozen(eq=False)
class DecodeCall:
    """One checked decode call (see the module docstring)."""

    metadata: MLADecodeMetadata
    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor | None
    softmax_scale: float
    k_scale: float
    shape: tuple[int, int, int, int]
    reads: tuple[torch.Tensor, ...]

    @classmethod
    def check(cls, backend: Any, what: str, q: torch.Tensor,
              kv_cache: torch.Tensor, out: torch.Tensor | None, softmax_scale: object,
              k_scale: object, indices: object = None) -> DecodeCall:
        """Every check of one call (``TypeError`` / ``ValueError`` naming ``what``); a sparse
        call when ``indices`` is given."""
        sparse = indices is not None
        if not (backend.supports_sparse if sparse else backend.supports_dense):
            kind = "sparse" if sparse else "dense"
            raise TypeError(f"{what}: {type(backend).__name__} does not run {kind} attention "
                            f"(supports_{kind} is False)")
        meta = backend.metadata
        scale = check_attention_scale(
            what, "softmax_scale", backend.scale if softmax_scale is None else softmax_scale,
            upper=FLOAT32_MAX, tensor_ok=True)
        kscale = 1.0 if k_scale is None else check_attention_scale(
            what, "k_scale", k_scale, upper=FLOAT32_MAX, tensor_ok=True)
        if not FLOAT32_TINY <= scale * kscale <= MAX_ATTENTION_SCALE:
            raise ValueError(f"{what}: softmax_scale * k_scale must be in [{FLOAT32_TINY:.4g}, "
                             f"{MAX_ATTENTION_SCALE:.4g}] (the kernels multiply q by it, and by "
                             f"log2(e), in float32), got {scale * kscale!r}")
        check_decode_inputs(what, meta, q, kv_cache, out, num_heads=backend.num_heads,
                            kv_lora_rank=backend.kv_lora_rank,
                            qk_rope_head_dim=backend.qk_rope_head_dim,
                            kv_cache_dtype=backend.kv_cache_dtype,
                            row_width=backend.kv_cache_row_width)
        if out is not None:   # the step's own copies, which every layer reads (not the caller's)
            check_out_spares_step(what, out, (meta.block_table_cpu, meta.seq_lens_cpu,
                                              *meta.on_device(q.device)))
        shape = (meta.batch, meta.query_len, backend.num_heads, backend.kv_lora_rank)
        checked = None if not sparse else check_sparse_indices(
            what, indices, shape[:2], int(kv_cache.shape[0]) * int(kv_cache.shape[1]),
            q.device)
        # Kernels read and write raw memory: a negative view (conj().imag) is materialised.
        q, kv_cache = q.resolve_neg(), kv_cache.resolve_neg()
        reads: tuple[torch.Tensor, ...] = (q, kv_cache, meta.block_table, meta.seq_lens,
                                           meta.block_table_cpu, meta.seq_lens_cpu)
        if isinstance(indices, torch.Tensor) and checked is not None:
            reads += (indices, checked)
        return cls(meta, q, kv_cache, checked, scale, kscale, shape, reads)

    def target(self, out: torch.Tensor | None) -> torch.Tensor:
        """What the kernel writes: ``out`` when it may be written in place (it shares memory
        with nothing in ``reads``), else a new buffer copied into ``out`` after the kernel."""
        if out is not None and writes_in_place(out, self.reads):
            return out
        return torch.empty(self.shape, dtype=self.q.dtype, device=self.q.device)


def check_own_verbs(cls: type[Any], base: Any) -> None:
    """Wrap the run verbs ``cls`` defines itself in the checks of ``base``
    (``MLADecodeBackend``; see the module docstring)."""
    for verb, hook, sparse in (("run_decode", "_run_decode", False),
                               ("run_sparse_decode", "_run_sparse_decode", True)):
        own = vars(cls).get(verb)
        if callable(own) and not getattr(own, "_app_checked", False):
            checked = _checked_verb(own, verb, sparse)
            checked._app_checked = True  # type: ignore[attr-defined]
            type.__setattr__(cls, verb, checked)
        if getattr(getattr(cls, hook), "__isabstractmethod__", False) \
                and getattr(cls, verb) is not getattr(base, verb):
            type.__setattr__(cls, hook, _unused_hook(hook, verb))


def runs_its_own_decode(backend: object) -> bool:
    """Whether ``backend``'s ``run_decode`` is its own and its ``_run_decode`` unused (its
    ``forward_decode`` then goes through ``run_decode``)."""
    return bool(getattr(getattr(type(backend), "_run_decode", None), "_app_unused_hook", False))


def _unused_hook(hook: str, verb: str) -> _Verb:
    def unused(self: object, *args: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines {verb} itself: its {hook} "
                                  f"is unused")
    unused._app_unused_hook = True  # type: ignore[attr-defined]
    unused.__name__ = unused.__qualname__ = hook
    return unused


def _checked_verb(own: _Verb, verb: str, sparse: bool) -> _Verb:
    @functools.wraps(own)
    def checked(self: Any, q: torch.Tensor, kv_cache: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
        what = f"{type(self).__name__}.{verb}"
        indices = None
        if sparse and args:
            indices, args = args[0], args[1:]
        elif sparse:
            if "indices" not in kwargs:
                raise TypeError(f"{what}: missing the indices argument")
            indices = kwargs.pop("indices")
        want = check_return_flag(what, "return_softmax_lse",
                                 kwargs.get("return_softmax_lse", False))
        out = kwargs.get("out")
        call = DecodeCall.check(self, what, q, kv_cache, out, kwargs.get("softmax_scale"),
                                kwargs.get("k_scale"), indices)
        if out is not None:
            kwargs["out"] = out if writes_in_place(out, call.reads) else None
        lead = (call.q, call.kv_cache) + ((call.indices,) if sparse else ())
        return _own_result(what, call, own(self, *lead, *args, **kwargs), want, out)
    return checked


def _own_result(what: str, call: DecodeCall, result: object, want_lse: bool,
                out: torch.Tensor | None) -> Any:
    """What a subclass's own verb returned, held to the contract (see the module docstring),
    the output copied into the caller's ``out=``."""
    got, lse = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    q = call.q
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != call.shape \
            or got.layout != torch.strided or got.dtype != q.dtype or got.device != q.device:
        raise TypeError(f"{what} returned {describe_value(result)}; expected out "
                        f"{list(call.shape)} {q.dtype} on {q.device} (q's dtype and device)"
                        f"{' and lse [H, B, query_len]' if want_lse else ''}")
    if want_lse:
        lse = checked_returned_lse(what, result, lse,
                                   [call.shape[2], call.shape[0], call.shape[1]], q.device)
    if out is not None and got is not out:
        out.copy_(got)
        got = out
    return (got, lse) if want_lse else got

