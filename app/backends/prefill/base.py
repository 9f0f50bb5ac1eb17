"""The MLA prefill backend contract: ``MLAPrefillBackend``, the template every prefill backend
runs through.

Prefill attention after MLA's latent up-projection is ragged multi-head attention:

- ``q: [total_q, num_heads, qk_head_dim]`` (``qk_head_dim = qk_nope + qk_rope``, DeepSeek 192),
- ``k: [total_kv, num_heads, qk_head_dim]``, ``v: [total_kv, num_heads, v_head_dim]`` (DeepSeek
  128; ``v`` may be a non-contiguous view),
- output ``[total_q, num_heads, v_head_dim]`` in ``q``'s dtype (a backend may document another),
- LSE ``[num_heads, total_q]``, float32, **natural log**, contiguous; rows that see no key have
  LSE ``-inf`` and output 0.

New tokens attend causally (bottom-right aligned when ``q_len != kv_len``); each chunk of cached
context is attended without a mask, and the partial results are merged by LSE.

The base is the template, as the decode base is for decode: ``prepare_metadata(metadata)`` checks
the step's ``cu_seqlens`` once (``StepLayouts``) and calls the step hook ``_prepare_step``;
``run_prefill_new_tokens`` / ``run_prefill_context_chunk`` check every tensor against the step
(``check_attention_inputs``), take ``out=`` (written after the kernel when it shares memory with
an input), allocate the ``[H, T]`` LSE, handle empty batches, call the kernel hook
``_run_prefill`` and give rows that see no key out 0 and LSE ``-inf``. A subclass implements
``_run_prefill``. One that implements the run verbs themselves instead (how the README showed
it before) still works and is checked the same way: its verbs are wrapped when the class is
made, so the checks and the ``out=`` and LSE rules run around them. A backend that declares
``supports_sparse`` also runs ``run_sparse_prefill`` (DeepSeek Sparse Attention, absorbed form:
each row attends to the latent rows its indices name; hook ``_run_sparse_prefill``); one that
does not declare ``supports_dense`` runs only that.
"""

from __future__ import annotations

import threading
import warnings
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs
import torch

from app._types import DeviceCapability, MLADimensions
from app._validation import INT32_MAX, check_int_at_least, is_int
from app.backends.contract import (
    check_attention_scale,
    check_hook_result,
    check_out_spares_step,
    check_return_flag,
    writes_in_place,
)
from app.backends.declarations import (
    BackendDeclarations,
    DeclarationRule,
    collection_of,
    find_declaration_problems,
)
from app.backends.prefill.checks import (
    call_reads,
    check_attention_inputs,
    check_own_verbs,
    empty_rows_mask,
    zero_empty_rows,
)
from app.backends.prefill.metadata import (
    ContextChunkMetadata,
    MLAPrefillMetadata,
    RaggedLayout,
    StepLayouts,
)
from app.backends.sparse.checks import SparseRowsCall

if TYPE_CHECKING:
    from app.backends.workspaces import KernelWorkspaces
    from app.config import EngineConfig

__all__ = [
    "R1_MLA_DIMENSIONS",
    "ContextChunkMetadata",
    "MLAPrefillBackend",
    "MLAPrefillMetadata",
    "MLAPrefillSelectorConfig",
    "MLASparsePrefillBackend",
    "StepCache",
]

#: DeepSeek R1's (and V3's) prefill dimensions.
R1_MLA_DIMENSIONS = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

#: The prefill declarations' types (``BackendDeclarations.declaration_problems``).
_PREFILL_DECLARATIONS: tuple[DeclarationRule, ...] = (
    ("supported_mla_dimensions", collection_of(lambda v: isinstance(v, MLADimensions)),
     "a tuple of MLADimensions (empty: any)"),
    ("requires_r1_mla_dimensions", lambda v: isinstance(v, bool), "a bool"),
    ("supports_out", lambda v: isinstance(v, bool), "a bool"),
)


def _optional_topk(instance: object, attribute: attrs.Attribute[int | None],
                   value: int | None) -> None:
    if value is not None:
        name = f"{type(instance).__name__}.{attribute.name} (or None)"
        check_int_at_least(name, value, 1)
        if value > INT32_MAX:  # ModelConfig.index_topk's range: selected positions are int32
            raise ValueError(f"{name} must be an int in [1, {INT32_MAX}], got {value!r}")


@attrs.frozen
class MLAPrefillSelectorConfig:
    """What the selector needs to know about the model: its dtype, MLA dimensions and
    ``index_topk`` (DeepSeek Sparse Attention's top-k; None: a dense model)."""

    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))
    mla_dimensions: MLADimensions = attrs.field(
        validator=attrs.validators.instance_of(MLADimensions))
    index_topk: int | None = attrs.field(default=None, validator=_optional_topk)

    @property
    def sparse(self) -> bool:
        """Whether the model's attention is sparse (``index_topk`` is set)."""
        return self.index_topk is not None

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> MLAPrefillSelectorConfig:
        """The selector config of an ``EngineConfig``'s model."""
        return cls(dtype=config.model.dtype, mla_dimensions=config.model.mla_dimensions,
                   index_topk=config.model.index_topk)


_T = TypeVar("_T")
_MISSING = object()


class StepCache:
    """What a backend derives from one step's layouts and reuses in every layer: device copies
    of lengths, masks, index tensors, kernel plans. Emptied by ``prepare_metadata``;
    thread-safe (layers of one step may run on several threads)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def get(self, layout: RaggedLayout, what: str, make: Callable[[], _T]) -> _T:
        """The ``what`` of ``layout`` (one of this step's layouts), made on first use."""
        key = (id(layout), what)
        found: Any = self._entries.get(key, _MISSING)   # a dict read is atomic: no lock
        if found is not _MISSING:
            hit: _T = found
            return hit
        value = make()
        with self._lock:
            kept: _T = self._entries.setdefault(key, value)
            return kept

    def clear(self) -> None:
        """Forget the previous step."""
        with self._lock:
            self._entries.clear()


class MLAPrefillBackend(BackendDeclarations):
    """Base class of every MLA prefill backend (built-in or third party).

    A subclass declares what it supports with class attributes and classmethods; the selector
    asks ``validate_configuration`` for the reasons it cannot run (empty = valid). An instance
    is built once per layer shape, gets ``prepare_metadata`` once per step, and then runs the
    causal new-token attention and one non-causal call per context chunk. A subclass
    implements ``_run_prefill`` (the kernel on checked inputs) and, to plan its kernels once per
    step, ``_prepare_step``; see the module docstring for what the base does around them.
    """

    #: MLA dimensions the kernels accept; empty means any.
    supported_mla_dimensions: ClassVar[Sequence[MLADimensions]] = ()
    #: vLLM's declaration: the kernels need DeepSeek R1's dimensions (128, 64, 128).
    requires_r1_mla_dimensions: ClassVar[bool] = False
    #: Whether ``out=`` is honoured (the kernel writes in place).
    supports_out: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_on_prepare" in vars(cls):
            warnings.warn(f"{cls.__qualname__}._on_prepare: the step hook is named "
                          f"_prepare_step now, for prefill and decode alike; _on_prepare is "
                          f"still called, for now", DeprecationWarning, stacklevel=3)
        check_own_verbs(cls, MLAPrefillBackend)

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """The base's problems, then those of ``supported_mla_dimensions``,
        ``requires_r1_mla_dimensions`` and ``supports_out``."""
        return (super().declaration_problems()
                + find_declaration_problems(cls, _PREFILL_DECLARATIONS))

    @classmethod
    def supports_mla_dimensions(cls, dims: MLADimensions) -> bool:
        """Whether ``dims`` (the prefill dimensions: ``qk_nope_head_dim``,
        ``qk_rope_head_dim``, ``v_head_dim``) is in ``supported_mla_dimensions`` (always, when
        that is empty), and R1's when ``requires_r1_mla_dimensions``."""
        if cls.requires_r1_mla_dimensions and dims != R1_MLA_DIMENSIONS:
            return False
        return not cls.supported_mla_dimensions or dims in cls.supported_mla_dimensions

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLAPrefillSelectorConfig) -> list[str]:
        """Every reason this backend cannot run here, in a fixed order: capability, dtype,
        availability, dimensions, sparsity (``sparsity_reasons``). An empty list means
        valid."""
        reasons = cls.platform_reasons(device_capability, selector_config.dtype)
        dims = selector_config.mla_dimensions
        if not cls.supports_mla_dimensions(dims):
            supported = ", ".join(str(d) for d in (
                cls.supported_mla_dimensions or [R1_MLA_DIMENSIONS]))
            reasons.append(f"Model does not have supported MLA dimensions "
                           f"(got {dims}; supported: {supported})")
        return reasons + cls.sparsity_reasons(getattr(selector_config, "index_topk", None))

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        """``device_capability``: the GPU's compute capability, passed in by whoever builds the
        backend (the container, from its platform; None on a CPU): a backend never asks
        ``torch.cuda`` for it at launch. ``workspaces``: the container's kernel workspaces
        (None: the backend makes its own when a kernel needs one)."""
        name = type(self).__name__
        if device_capability is not None and not isinstance(device_capability, DeviceCapability):
            raise TypeError(f"{name}: device_capability must be a DeviceCapability or None, "
                            f"got {device_capability!r}")
        for what, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            check_int_at_least(f"{name}: {what}", value, 0)
        if num_heads < 1 or v_head_dim < 1 or qk_nope_head_dim + qk_rope_head_dim < 1:
            raise ValueError(f"{name}: num_heads, v_head_dim and the qk head dim must be >= 1, "
                             f"got {num_heads}, {v_head_dim}, "
                             f"{qk_nope_head_dim + qk_rope_head_dim}")
        self.scale = check_attention_scale(name, "scale", scale)
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.config = config
        self.device_capability = device_capability
        self.workspaces = workspaces
        self._metadata: MLAPrefillMetadata | None = None
        self._layouts: StepLayouts | None = None
        #: Derived from the current step's layouts, shared by every layer of the step.
        self._step_cache = StepCache()

    @classmethod
    def from_config(cls, config: EngineConfig,
                    device_capability: DeviceCapability | None = None, *,
                    workspaces: KernelWorkspaces | None = None) -> MLAPrefillBackend:
        """An instance for ``config.model``'s shape (``device_capability`` and ``workspaces``
        as in the constructor; passed only when given, so a third-party constructor without
        them still works)."""
        m = config.model
        extra: dict[str, Any] = {}
        if device_capability is not None:
            extra["device_capability"] = device_capability
        if workspaces is not None:
            extra["workspaces"] = workspaces
        return cls(num_heads=m.num_heads, scale=m.scale, kv_lora_rank=m.kv_lora_rank,
                   qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                   v_head_dim=m.v_head_dim, config=config, **extra)

    # -- the step ----------------------------------------------------------------------------

    def prepare_metadata(self, prefill_metadata: MLAPrefillMetadata) -> None:
        """Take the step's layout: check every ``cu_seqlens`` once, then ``_prepare_step``
        (kernel plans, once per step). A step refused by the checks leaves the previous one in
        place; one whose plans fail leaves no step (every run then asks for
        ``prepare_metadata``)."""
        layouts = self._take_step(prefill_metadata)
        try:
            self._prepare_step(layouts)
        except BaseException:
            self._metadata = self._layouts = None
            raise

    def _take_step(self, prefill_metadata: object) -> StepLayouts:
        """Check the step's metadata and make it this backend's current step."""
        metadata = self._checked_metadata(prefill_metadata)
        layouts = StepLayouts.from_metadata(metadata, self._label())
        self._metadata, self._layouts = metadata, layouts
        self._step_cache.clear()
        return layouts

    def _prepare_step(self, layouts: StepLayouts) -> None:
        """Hook: plan kernels for the step, from its checked layouts (default: the
        deprecated ``_on_prepare``, which does nothing)."""
        self._on_prepare(layouts)

    def _on_prepare(self, layouts: StepLayouts) -> None:
        """The step hook's old name (deprecated: override ``_prepare_step``)."""

    def _checked_metadata(self, prefill_metadata: object) -> MLAPrefillMetadata:
        """``prefill_metadata`` if it is an ``MLAPrefillMetadata``, else ``TypeError``."""
        if not isinstance(prefill_metadata, MLAPrefillMetadata):
            raise TypeError(f"{type(self).__name__}.prepare_metadata: expected "
                            f"MLAPrefillMetadata, got {type(prefill_metadata).__name__}")
        return prefill_metadata

    @property
    def metadata(self) -> MLAPrefillMetadata:
        """The metadata of the current step (``ValueError`` before ``prepare_metadata``)."""
        if self._metadata is None:
            raise ValueError(f"{type(self).__name__}: call prepare_metadata() before running")
        return self._metadata

    def context_chunk(self, chunk: int) -> ContextChunkMetadata:
        """The metadata of context chunk ``chunk`` (``ValueError`` when out of range)."""
        chunks = self.metadata.context_chunks
        if not is_int(chunk) or not 0 <= chunk < len(chunks):
            raise ValueError(f"{type(self).__name__}: context chunk index must be in "
                             f"[0, {len(chunks)}), got {chunk!r}")
        return chunks[chunk]

    def _step(self) -> StepLayouts:
        """The current step's checked layouts (``ValueError`` before ``prepare_metadata``;
        ``TypeError`` on a sparse-only backend: the dense verbs read them)."""
        if not self.supports_dense:
            raise TypeError(f"{self._label()}: {type(self).__name__} runs only sparse attention "
                            f"(supports_dense is False): call run_sparse_prefill")
        if self._layouts is None or self._metadata is None:
            raise ValueError(f"{type(self).__name__}: call prepare_metadata() before running")
        return self._layouts

    def _label(self) -> str:
        """The backend's name for messages (its class name when it declares none)."""
        try:
            return self.get_name()
        except TypeError:
            return type(self).__name__

    # -- the run verbs (vLLM's) ----------------------------------------------------------------

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens (bottom-right aligned).

        ``q: [total_q, H, qk_head_dim]``, ``k: [total_new_kv, H, qk_head_dim]``,
        ``v: [total_new_kv, H, v_head_dim]``. Returns ``out [total_q, H, v_head_dim]`` (written
        into ``out=`` when given), and with ``return_softmax_lse`` also ``lse [H, total_q]``
        float32, natural log.
        """
        if not isinstance(return_softmax_lse, bool):   # the label only for the message
            check_return_flag(f"{self._label()}.run_prefill_new_tokens",
                              "return_softmax_lse", return_softmax_lse)
        result, lse = self._run(-1, self._step().new_tokens, q, k, v, True, out,
                                return_softmax_lse)
        if not return_softmax_lse:
            return result
        if lse is None:  # pragma: no cover - _run allocates it when asked
            raise RuntimeError("no LSE computed")
        return result, lse

    def run_prefill_context_chunk(self, chunk: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of the new tokens over context chunk ``chunk``.

        ``q: [total_q, H, qk_head_dim]``, ``k: [chunk.total_kv, H, qk_head_dim]``,
        ``v: [chunk.total_kv, H, v_head_dim]``. Returns ``(out [total_q, H, v_head_dim],
        lse [H, total_q] float32 natural log)``; a request with an empty chunk gets LSE -inf.
        """
        self.context_chunk(chunk)
        result, lse = self._run(chunk, self._step().chunks[chunk], q, k, v, False, out, True)
        if lse is None:  # pragma: no cover - _run allocates it when asked
            raise RuntimeError("no LSE computed")
        return result, lse

    def run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *,
                           return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                           softmax_scale: float | None = None,
                           k_scale: float | torch.Tensor | None = None
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Sparse prefill in the absorbed form (DeepSeek Sparse Attention): each query row
        attends only to the latent rows its indices name (a backend with ``supports_sparse``;
        ``TypeError`` on one without). Needs no step metadata: the indices carry the layout.

        ``q [T, H, kv_lora_rank + qk_rope_head_dim]`` (queries with ``W_UK`` absorbed, any
        strides), ``kv [N, kv_lora_rank + qk_rope_head_dim]`` latent rows of q's dtype (the
        paged cache viewed flat, ``kv_cache.view(-1, D)``, or rows gathered into a workspace,
        one context chunk at a time), ``indices [T, topk]`` int32 rows of ``kv`` in ``[-1,
        N)`` (``-1``: padding; each entry one softmax term). Returns ``out [T, H,
        kv_lora_rank]`` in q's dtype and with ``return_softmax_lse`` also ``lse [H, T]``
        float32 natural log, so that chunks merge with ``merge_attn_states``; a row whose
        entries are all ``-1`` gets out 0 and LSE ``-inf``. ``softmax_scale`` defaults to the
        constructor's ``scale``, ``k_scale`` (the cache's dequantisation) to 1."""
        if not self.supports_sparse:
            raise TypeError(f"{self._label()}.run_sparse_prefill: {type(self).__name__} does "
                            f"not run sparse attention (supports_sparse is False)")
        call = SparseRowsCall.check(
            f"{self._label()}.run_sparse_prefill", q, kv, indices, out,
            self.scale if softmax_scale is None else softmax_scale, k_scale,
            return_softmax_lse, num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, dtypes=tuple(self.supported_dtypes))
        if call.rows:
            hook: Callable[..., object] = self._run_sparse_prefill   # None, or a TypeError
            check_hook_result(self, "_run_sparse_prefill", hook(
                call.q, call.kv, call.indices, call.target, call.lse, call.softmax_scale,
                call.k_scale), call.target)
        return call.result(out)

    def _run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                            k_scale: float) -> None:
        """Run the sparse kernel on checked inputs (T >= 1; a backend with
        ``supports_sparse`` overrides it): write ``out [T, H, kv_lora_rank]`` (contiguous, q's
        dtype) and, when given, ``lse [T, H]`` (contiguous float32, natural log, token-major
        as the decode hooks write it; the base lays it out head-major); return None.
        ``indices`` is the base's private checked copy, never the caller's tensor."""
        raise NotImplementedError(f"{type(self).__name__} declares supports_sparse but does "
                                  f"not implement _run_sparse_prefill")

    def _check_inputs(self, layout: RaggedLayout, q: object, k: object, v: object,
                      out: object) -> None:
        """Every check of one call's tensors against the step (``check_attention_inputs``), and
        an ``out=`` that shares memory with the step's prefix sums refused."""
        if out is not None and self._layouts is not None:
            step = self._layouts
            check_out_spares_step(self._label(), out, (
                t for lay in (step.new_tokens, *step.chunks)
                for t in (lay.cu_q, lay.cu_kv, lay.cu_q_cpu, lay.cu_kv_cpu)))
        check_attention_inputs(
            self._label(), q, k, v, num_heads=self.num_heads, qk_head_dim=self.qk_head_dim,
            v_head_dim=self.v_head_dim, total_q=layout.total_q, total_kv=layout.total_kv,
            dtypes=self.supported_dtypes, device=layout.cu_q.device, out=out,
            out_dtype=self._out_dtype(q.dtype) if isinstance(q, torch.Tensor) else None)

    def _out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The output dtype for inputs of ``dtype`` (default: the same)."""
        return dtype

    def _run(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, causal: bool, out: torch.Tensor | None, want_lse: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The template of both verbs: checks, ``out=``, the LSE, empty batches, the kernel
        hook, rows that see no key. Returns ``(out, lse or None)``."""
        self._check_inputs(layout, q, k, v, out)
        # Kernels read and write raw memory: a negative view (conj().imag) is materialised.
        q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
        # An out= sharing memory with anything the kernel reads is written after the kernel.
        in_place = out is not None and writes_in_place(out, call_reads(layout, q, k, v))
        result = out if in_place and out is not None else torch.empty(
            layout.total_q, self.num_heads, self.v_head_dim, dtype=self._out_dtype(q.dtype),
            device=q.device)
        lse = (torch.empty(self.num_heads, layout.total_q, dtype=torch.float32, device=q.device)
               if want_lse else None)
        if layout.total_q == 0:
            pass
        elif layout.total_kv == 0:
            result.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            hook: Callable[..., object] = self._run_prefill   # None, or a TypeError
            check_hook_result(self, "_run_prefill", hook(call, layout, q, k, v, causal, result,
                                                         lse), result)
            zero_empty_rows(result, lse, self._empty_mask(layout, causal, q.device))
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        return result, lse

    @abstractmethod
    def _run_prefill(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                     ) -> None:
        """Run the kernel on checked inputs (at least one query and one key): write ``out
        [T, H, Dv]`` (contiguous, ``_out_dtype``) and, when given, ``lse [H, T]`` (contiguous
        float32, natural log), and return None (a returned tensor is a ``TypeError``: the base
        hands the caller ``out``). ``call`` is -1 for the new tokens, else the context chunk
        index; ``layout`` its checked lengths. Rows that see no key are fixed up after."""

    def _empty_mask(self, layout: RaggedLayout, causal: bool,
                    device: torch.device) -> torch.Tensor | None:
        return self._step_cache.get(layout, "empty-causal" if causal else "empty",
                                    lambda: empty_rows_mask(layout.empty_rows(causal),
                                                            layout.total_q, device))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_heads={self.num_heads}, "
                f"qk_head_dim={self.qk_head_dim}, v_head_dim={self.v_head_dim})")

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly description of the instance."""
        return {"name": self.get_name(), "class": f"{type(self).__module__}."
                f"{type(self).__qualname__}", "num_heads": self.num_heads,
                "qk_head_dim": self.qk_head_dim, "v_head_dim": self.v_head_dim}


class MLASparsePrefillBackend(MLAPrefillBackend):
    """Base of a prefill backend that runs sparse attention only (``supports_dense = False``):
    implement ``_run_sparse_prefill``; the base refuses the dense verbs before any hook."""

    supports_dense: ClassVar[bool] = False
    supports_sparse: ClassVar[bool] = True

    def _run_prefill(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                     ) -> None:
        """Never called: the base refuses dense calls to a sparse-only backend."""
        raise NotImplementedError(f"{type(self).__name__} runs sparse attention only")

    @abstractmethod
    def _run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                            k_scale: float) -> None:
        """The sparse kernel (see ``MLAPrefillBackend._run_sparse_prefill``)."""
