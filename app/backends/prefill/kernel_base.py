"""The public base of kernel backends: ``RaggedKernelBackend``, its ragged layouts and input
checks, and (re-exported from ``app.backends.workspaces``) the per-device kernel workspaces.
Third-party backends build on it as the built-ins do.

A kernel must never be handed a shape it would read out of bounds, so every backend calls
``check_attention_inputs`` before a launch (rank, heads, head dims, dtype, device, token counts
matching the ``cu_seqlens``), and ``RaggedLayout.from_cu_seqlens`` checks each ``cu_seqlens``
once per step in ``prepare_metadata`` (host copies only: no device sync). Every failure raises
``ValueError`` naming the expected and the actual value.
"""

from __future__ import annotations

import itertools
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs
import torch

from app._validation import INT32_MAX, check_dense, check_writable_out, tensors_overlap
from app.backends.lse import lse_rows_to_heads_tokens
from app.backends.prefill.base import ContextChunkMetadata, MLAPrefillBackend, MLAPrefillMetadata
from app.backends.workspaces import KernelWorkspaces

if TYPE_CHECKING:
    from app._types import DeviceCapability
    from app.config import EngineConfig

__all__ = [
    "KernelWorkspaces",
    "RaggedKernelBackend",
    "RaggedLayout",
    "StepCache",
    "StepLayouts",
    "check_attention_inputs",
    "check_cu_seqlens",
    "empty_rows_mask",
    "unit_stride",
    "zero_empty_rows",
]

_INT_DTYPES = (torch.int32, torch.int64)


def check_cu_seqlens(cu: torch.Tensor, what: str, *, batch: int | None = None,
                     total: int | None = None) -> list[int]:
    """Check a host ``cu_seqlens`` (1-D int, starts at 0, non-decreasing, ends at ``total``,
    ``batch + 1`` entries) and return it as a list of ints."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.dtype not in _INT_DTYPES:
        raise ValueError(f"{what}: expected a 1-D int32/int64 tensor, got shape "
                         f"{list(cu.shape)} dtype {cu.dtype}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{what}: expected {batch + 1} entries (batch {batch} + 1), "
                         f"got {cu.numel()}")
    values = [int(x) for x in cu.tolist()]
    if not values:
        raise ValueError(f"{what}: expected at least 1 entry, got 0")
    if values[0] != 0:
        raise ValueError(f"{what}: expected to start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{what}: expected non-decreasing prefix sums, got "
                             f"{values[i - 1]} then {values[i]} at index {i}")
    if values[-1] > INT32_MAX:  # int64 sums narrowed to the kernels' int32 would wrap around
        raise ValueError(f"{what}: ends at {values[-1]}, beyond int32 (at most {INT32_MAX} "
                         f"tokens in all); refused, not narrowed")
    if total is not None and values[-1] != total:
        raise ValueError(f"{what}: expected to end at the token count {total}, got {values[-1]}")
    return values


def _check_device_copy(device_cu: torch.Tensor, host: torch.Tensor, what: str) -> None:
    if not isinstance(device_cu, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(device_cu).__name__}")
    if device_cu.dtype != torch.int32:
        raise ValueError(f"{what}: kernels need int32 prefix sums, got {device_cu.dtype}")
    if tuple(device_cu.shape) != tuple(host.shape):
        raise ValueError(f"{what}: expected shape {list(host.shape)} (as the host copy), "
                         f"got {list(device_cu.shape)}")


def _device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The checked host prefix sums on ``device`` (the host tensor itself on the CPU)."""
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


@attrs.frozen
class RaggedLayout:
    """One ragged attention call's layout, read once from the host ``cu_seqlens``.

    ``q_lens[b]`` queries of request b attend ``kv_lens[b]`` keys; ``q_starts``/``kv_starts``
    are the offsets of each request in the packed tensors.
    """

    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    cu_q_cpu: torch.Tensor
    cu_kv_cpu: torch.Tensor
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    total_q: int
    total_kv: int
    max_q: int
    max_kv: int

    @property
    def batch(self) -> int:
        """The number of requests."""
        return len(self.q_lens)

    @classmethod
    def from_cu_seqlens(cls, cu_q_cpu: torch.Tensor, cu_kv_cpu: torch.Tensor,
                        cu_q: torch.Tensor, cu_kv: torch.Tensor, *, what: str,
                        total_q: int, total_kv: int, max_q: int, max_kv: int) -> RaggedLayout:
        """Check both prefix sums (host values, device dtype/shape) and build the layout.

        ``max_q``/``max_kv`` are the metadata's maxima: they must be at least the real
        maxima (kernels size their grids with them)."""
        q = check_cu_seqlens(cu_q_cpu, f"{what}: cu_seqlens_q", total=total_q)
        kv = check_cu_seqlens(cu_kv_cpu, f"{what}: cu_seqlens_kv", batch=len(q) - 1,
                              total=total_kv)
        _check_device_copy(cu_q, cu_q_cpu, f"{what}: cu_seqlens_q (device copy)")
        _check_device_copy(cu_kv, cu_kv_cpu, f"{what}: cu_seqlens_kv (device copy)")
        q_lens = tuple(b - a for a, b in itertools.pairwise(q))
        kv_lens = tuple(b - a for a, b in itertools.pairwise(kv))
        for name, lens, declared in (("query", q_lens, max_q), ("kv", kv_lens, max_kv)):
            actual = max(lens, default=0)
            if declared < actual:
                raise ValueError(f"{what}: max {name} length is {actual}, but the metadata "
                                 f"declares {declared}")
        # Copies of the checked values, never the caller's tensors: the caller may reuse
        # them, and a device copy that disagreed with the host one would be read unchecked.
        q_host = cu_q_cpu.to(torch.int32, copy=True)
        kv_host = cu_kv_cpu.to(torch.int32, copy=True)
        return cls(cu_q=_device_copy(q_host, cu_q.device),
                   cu_kv=_device_copy(kv_host, cu_kv.device), cu_q_cpu=q_host,
                   cu_kv_cpu=kv_host, q_lens=q_lens, kv_lens=kv_lens,
                   q_starts=tuple(q[:-1]), kv_starts=tuple(kv[:-1]), total_q=total_q,
                   total_kv=total_kv, max_q=max(q_lens, default=0),
                   max_kv=max(kv_lens, default=0))

    def empty_rows(self, causal: bool) -> list[tuple[int, int]]:
        """``(start, stop)`` query-row ranges that see no key: requests with no keys, and
        with a causal (bottom-right) mask the first ``q_len - kv_len`` rows of a request."""
        ranges = []
        for start, ql, kl in zip(self.q_starts, self.q_lens, self.kv_lens, strict=True):
            dead = ql if kl == 0 else (max(0, ql - kl) if causal else 0)
            if dead:
                ranges.append((start, start + dead))
        return ranges

    def runs(self) -> list[tuple[int, int, int, int, int]]:
        """Maximal runs of consecutive requests with equal ``(q_len, kv_len)``, as
        ``(q_start, kv_start, count, q_len, kv_len)``: each run is a dense batch."""
        out: list[tuple[int, int, int, int, int]] = []
        for qs, ks, ql, kl in zip(self.q_starts, self.kv_starts, self.q_lens, self.kv_lens,
                                  strict=True):
            if out and out[-1][3] == ql and out[-1][4] == kl:
                q0, k0, n, _, _ = out[-1]
                out[-1] = (q0, k0, n + 1, ql, kl)
            else:
                out.append((qs, ks, 1, ql, kl))
        return out


@attrs.frozen
class StepLayouts:
    """The layouts of one prefill step: the causal new-token call and each context chunk."""

    new_tokens: RaggedLayout
    chunks: tuple[RaggedLayout, ...]

    @classmethod
    def from_metadata(cls, md: MLAPrefillMetadata, who: str) -> StepLayouts:
        """Check every ``cu_seqlens`` of ``md`` and build the layouts (no device sync)."""
        new = RaggedLayout.from_cu_seqlens(
            md.cu_seqlens_q_cpu, md.cu_seqlens_kv_new_cpu, md.cu_seqlens_q,
            md.cu_seqlens_kv_new, what=f"{who}: new tokens", total_q=md.total_q,
            total_kv=md.total_new_kv, max_q=md.max_query_len, max_kv=md.max_new_kv_len)
        chunks = []
        for i, chunk in enumerate(md.context_chunks):
            if not isinstance(chunk, ContextChunkMetadata):
                raise ValueError(f"{who}: context chunk {i}: expected ContextChunkMetadata, "
                                 f"got {type(chunk).__name__}")
            chunks.append(RaggedLayout.from_cu_seqlens(
                md.cu_seqlens_q_cpu, chunk.cu_seqlens_kv_cpu, md.cu_seqlens_q,
                chunk.cu_seqlens_kv, what=f"{who}: context chunk {i}", total_q=md.total_q,
                total_kv=chunk.total_kv, max_q=md.max_query_len, max_kv=chunk.max_seq_len_kv))
        return cls(new_tokens=new, chunks=tuple(chunks))


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
    allowed = tuple(dtypes)
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


_T = TypeVar("_T")


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
        with self._lock:
            if key in self._entries:
                found: _T = self._entries[key]
                return found
        value = make()
        with self._lock:
            kept: _T = self._entries.setdefault(key, value)
            return kept

    def clear(self) -> None:
        """Forget the previous step."""
        with self._lock:
            self._entries.clear()


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (a split ``v`` view is), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class RaggedKernelBackend(MLAPrefillBackend):
    """The plumbing every built-in backend shares; a subclass implements ``_launch``.

    ``prepare_metadata`` checks the step's ``cu_seqlens`` once (host copies); each run checks
    the tensors, allocates (or takes) ``out`` and the ``[H, T]`` LSE, handles empty batches,
    calls ``_launch`` and then gives rows that see no key out 0 and LSE ``-inf`` (kernels
    disagree on those rows: FA2 writes +inf, the aten CPU kernel 0).
    """

    supported_dtypes: ClassVar[Sequence[torch.dtype]] = (torch.float16, torch.bfloat16)
    #: Whether the kernel needs CUDA tensors.
    requires_cuda: ClassVar[bool] = True
    #: Whether ``_launch`` always needs an LSE buffer (even when the caller wants none).
    needs_lse_buffer: ClassVar[bool] = False

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, config, device_capability=device_capability,
                         workspaces=workspaces)
        self._layouts: StepLayouts | None = None
        #: Derived from the current step's layouts, shared by every layer of the step.
        self._step_cache = StepCache()

    def prepare_metadata(self, prefill_metadata: MLAPrefillMetadata) -> None:
        """Check every ``cu_seqlens`` of the step once, then ``_on_prepare`` (kernel plans).
        A step refused by the checks leaves the previous one in place; one whose plans fail
        leaves no step (every run then asks for ``prepare_metadata``)."""
        layouts = StepLayouts.from_metadata(self._checked_metadata(prefill_metadata),
                                            self.get_name())
        super().prepare_metadata(prefill_metadata)
        self._layouts = layouts
        self._step_cache.clear()
        try:
            self._on_prepare(layouts)
        except BaseException:
            self._metadata = self._layouts = None
            raise

    def _on_prepare(self, layouts: StepLayouts) -> None:
        """Hook: plan kernels for the step (default: nothing)."""

    def _step(self) -> StepLayouts:
        if self._layouts is None or self._metadata is None:
            raise ValueError(f"{type(self).__name__}: call prepare_metadata() before running")
        return self._layouts

    def _workspace(self, name: str, nbytes: int, device: torch.device, *,
                   zeroed: bool = False) -> torch.Tensor:
        """Kernel workspace ``name`` on ``device`` from the workspaces passed in (the
        container's), else from this backend's own."""
        if self.workspaces is None:
            self.workspaces = KernelWorkspaces()
        return self.workspaces.get(name, nbytes, device, zeroed=zeroed)

    def _require_capability(self) -> DeviceCapability:
        """The capability passed in; ``ValueError`` when the backend was built without one (a
        GPU kernel needs it to pick its variant)."""
        if self.device_capability is None:
            raise ValueError(f"{self.get_name()}: built without a device_capability; build "
                             "it through the container (container.mla_prefill_backend()) or "
                             "pass device_capability=platform.get_device_capability()")
        return self.device_capability

    def _out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The output dtype for inputs of ``dtype`` (default: the same)."""
        return dtype

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal (bottom-right) attention of the new tokens; see ``MLAPrefillBackend``."""
        if not isinstance(return_softmax_lse, bool):
            raise TypeError(f"{self.get_name()}.run_prefill_new_tokens: return_softmax_lse "
                            f"must be a bool, got {return_softmax_lse!r}")
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
        """Non-causal attention over context chunk ``chunk``; see ``MLAPrefillBackend``."""
        self.context_chunk(chunk)
        result, lse = self._run(chunk, self._step().chunks[chunk], q, k, v, False, out, True)
        if lse is None:  # pragma: no cover - _run allocates it when asked
            raise RuntimeError("no LSE computed")
        return result, lse

    def _run(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, causal: bool, out: torch.Tensor | None, want_lse: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        name = self.get_name()
        check_attention_inputs(
            name, q, k, v, num_heads=self.num_heads, qk_head_dim=self.qk_head_dim,
            v_head_dim=self.v_head_dim, total_q=layout.total_q, total_kv=layout.total_kv,
            dtypes=self.supported_dtypes, device=layout.cu_q.device, out=out,
            out_dtype=self._out_dtype(q.dtype) if isinstance(q, torch.Tensor) else None)
        if self.requires_cuda and q.device.type != "cuda":
            raise ValueError(f"{name}: expected CUDA tensors (the kernel runs on a GPU), "
                             f"got device {q.device}")
        # Kernels read and write raw memory: a negative view (conj().imag) is materialised.
        q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
        # An out= sharing memory with an input is written after the kernel, never during it.
        result = out if out is not None and out.is_contiguous() and not out.is_neg() and not any(
            tensors_overlap(out, t) for t in (q, k, v)) else torch.empty(
            layout.total_q, self.num_heads, self.v_head_dim, dtype=self._out_dtype(q.dtype),
            device=q.device)
        lse = (torch.empty(self.num_heads, layout.total_q, dtype=torch.float32, device=q.device)
               if want_lse or self.needs_lse_buffer else None)
        if layout.total_q == 0:
            pass
        elif layout.total_kv == 0:
            result.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            self._launch(call, layout, q, k, v, causal, result, lse)
            zero_empty_rows(result, lse, self._empty_mask(layout, causal, q.device))
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        return result, lse if want_lse else None

    @abstractmethod
    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        """Run the kernel: write ``out [T, H, Dv]`` and, if given, ``lse [H, T]`` (natural
        log). ``call`` is -1 for the new tokens, else the context chunk index."""

    def _empty_mask(self, layout: RaggedLayout, causal: bool,
                    device: torch.device) -> torch.Tensor | None:
        return self._step_cache.get(layout, f"empty-{causal}", lambda: empty_rows_mask(
            layout.empty_rows(causal), layout.total_q, device))

    def _token_index(self, layout: RaggedLayout,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(request, position)`` of every query token (device tensors, cached per step)."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            req = torch.repeat_interleave(torch.arange(layout.batch),
                                          torch.tensor(layout.q_lens, dtype=torch.long))
            pos = torch.arange(layout.total_q) - torch.tensor(layout.q_starts,
                                                              dtype=torch.long)[req]
            return req.to(device, non_blocking=True), pos.to(device, non_blocking=True)

        return self._step_cache.get(layout, "index", make)

    def _kv_lens(self, layout: RaggedLayout, device: torch.device) -> torch.Tensor:
        """Per-request KV lengths, int32, on ``device`` (cached per step)."""
        return self._step_cache.get(layout, "kv_lens", lambda: torch.tensor(
            layout.kv_lens, dtype=torch.int32).to(device, non_blocking=True))

    def _copy_kernel_lse(self, lg: torch.Tensor, layout: RaggedLayout, lse: torch.Tensor, *,
                         tokens_first: bool, base2: bool = False) -> None:
        """A kernel's LSE into ``lse``: ``[T, H]`` (``tokens_first``), ``[H, T]``, or a
        padded per-request ``[B, H, L]`` (gathered)."""
        if lg.dim() == 3:
            req, pos = self._token_index(layout, lg.device)
            lg, tokens_first = lg[req, :, pos], True
        lse_rows_to_heads_tokens(lg, self.num_heads, layout.total_q, tokens_first=tokens_first,
                                 base2=base2, out=lse)
