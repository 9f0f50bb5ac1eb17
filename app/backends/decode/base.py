"""The MLA decode backend contract: ``MLADecodeBackend`` and ``MLADecodeSelectorConfig``.

Decode attention runs in MLA's *absorbed* form over the paged latent cache (one KV head):

- ``q [B, query_len, H, kv_lora_rank + qk_rope_head_dim]`` (the query with ``W_UK`` absorbed;
  any strides; float16 / bfloat16 / float32),
- ``kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` of the backend's
  ``kv_cache_dtype``: row ``r`` of block ``b`` is one token's latent ``c_kv`` (first
  ``kv_lora_rank`` values, which are also the value) followed by its rope key,
  An FP8 cache (``app.kvcache.cache_dtypes``): ``fp8`` / ``fp8_e4m3`` is float8_e4m3fn rows of
  the same width dequantised by ``k_scale``; ``fp8_ds_mla`` is uint8 rows of DeepSeek's FlashMLA
  layout (656 bytes at 512 + 64: e4m3 latent, a float32 scale per 128 values, bf16 rope). A
  backend declares the cache dtypes it reads (``supported_kv_cache_dtypes``) and selection
  says which do not,
- ``block_table`` int32 ``[B, max_blocks]`` and ``seq_lens`` int32 ``[B]`` (given once per step
  to ``prepare_metadata``, as an ``MLADecodeMetadata`` or the three tensors themselves): token
  ``t`` of request ``b`` is row ``t % block_size`` of block
  ``block_table[b, t // block_size]``; ``seq_lens[b]`` counts this step's ``query_len`` new
  tokens, which are already written to the cache,
- output ``out [B, query_len, H, kv_lora_rank]`` in ``q``'s dtype, and with
  ``return_softmax_lse`` the LSE ``[H, B, query_len]`` float32, natural log (head-major, as
  prefill's ``[H, T]``).

Query row ``i`` (0-based) of request ``b`` sees keys ``[0, seq_lens[b] - query_len + i]``
(causal inside the step, for multi-token prediction), so every row sees at least one key. The
logits are ``softmax_scale * k_scale * (q . k)`` and the output is
``k_scale * sum(p * c_kv)``: ``k_scale`` dequantises the cache (FP8), 1 when omitted. Every scale
is an argument of every call; nothing is cached from an earlier call (a profiling run's
placeholder scales must never leak into later calls).

**Non-finite keys.** A NaN or infinity in a key makes the rows that see it non-finite; a key a
row does not see must not change that row, so that a speculative step's rows before a poisoned
draft keep their (accepted) tokens. A backend declares whether its kernel keeps to that inside
a multi-token step: ``isolates_nonfinite_keys = True`` (the default): exactly the rows that see
the key are non-finite. ``False``: the rows that see it are non-finite, and rows of the same
request and step that do not see it may be non-finite too (a kernel that multiplies a masked
key's value by its probability 0 over a whole tile: ``0 * NaN`` is NaN; flashinfer's fa2/fa3
MLA kernels, measured on an H100), but never finite and wrong. Keys past a request's
``seq_lens`` (the unused rows of its last block) must change nothing, on every backend: so a
step of ``query_len`` 1 isolates everywhere. The conformance kit's ``nonfinite_keys`` case
holds each backend to its declaration; ``MLAEngine`` reads it to decide which rows of a
speculative step it may trust (``app.mla.engine``).

The base is the template, as the prefill base is for prefill: ``prepare_metadata(metadata)``
checks the step once and calls the step hook ``_prepare_step``; ``run_decode`` checks every
tensor and scale, takes ``out=`` (written after the kernel when it shares memory with an
input), lays out the LSE and calls the kernel hook ``_run_decode``. ``forward_decode`` is the
verb's old form (``return_lse=``, LSE ``[B, query_len, H]``), kept for callers written
against it. A backend that declares ``supports_sparse`` also runs ``run_sparse_decode`` (DeepSeek
Sparse Attention: each row attends to the cache slots its indices name; hook
``_run_sparse_decode``); one that does not declare ``supports_dense`` runs only that.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from app._types import DeviceCapability, MLADimensions
from app._validation import check_int_at_least, is_int
from app.backends.contract import check_attention_scale, check_hook_result, check_return_flag
from app.backends.declarations import (
    BackendDeclarations,
    DeclarationRule,
    collection_of,
    find_declaration_problems,
)
from app.backends.decode.calls import DecodeCall, check_own_verbs, runs_its_own_decode
from app.backends.decode.metadata import MAX_QUERY_LEN, DecodeMetadata, MLADecodeMetadata
from app.backends.decode.selector_config import MLADecodeSelectorConfig
from app.config import KV_CACHE_DTYPES
from app.kvcache.cache_dtypes import canonical_kv_cache_dtype, ds_mla_row_bytes

if TYPE_CHECKING:
    from app.backends.workspaces import WorkspaceSource
    from app.config import EngineConfig

__all__ = ["MAX_QUERY_LEN", "DecodeMetadata", "MLADecodeBackend", "MLADecodeMetadata",
           "MLADecodeSelectorConfig", "MLASparseDecodeBackend"]


def _latent_pairs(value: object) -> bool:
    return collection_of(lambda v: isinstance(v, tuple) and len(v) == 2
                         and all(is_int(d) for d in v))(value)

#: The decode declarations' types (``BackendDeclarations.declaration_problems``).
_DECODE_DECLARATIONS: tuple[DeclarationRule, ...] = (
    ("supported_block_sizes", collection_of(is_int), "a tuple of ints (empty: any)"),
    ("supported_mla_dimensions", collection_of(lambda v: isinstance(v, MLADimensions)),
     "a tuple of MLADimensions (kv_lora_rank, qk_rope_head_dim; empty: any)"),
    ("supported_head_dims", _latent_pairs,
     "a tuple of (kv_lora_rank, qk_rope_head_dim) int pairs (empty: any)"),
    ("max_query_len", is_int, "an int"),
    ("isolates_nonfinite_keys", lambda v: isinstance(v, bool), "a bool"),
    ("supported_kv_cache_dtypes", lambda v: v is None or collection_of(
        lambda name: name in KV_CACHE_DTYPES)(v),
     f"None or a tuple of cache dtype names ({', '.join(KV_CACHE_DTYPES)})"),
    ("kv_cache_dtype_notes", lambda v: isinstance(v, Mapping) and all(
        isinstance(k, str) and isinstance(n, str) for k, n in v.items()),
     "a dict of cache dtype name -> why it is not read"),
)


class MLADecodeBackend(BackendDeclarations):
    """Base class of every MLA decode backend (built-in or third party).

    **Class declarations** (what the selector reads): those of ``BackendDeclarations`` (name,
    ``supported_dtypes`` (cache dtypes), ``compute_capabilities``, ``probe``,
    ``install_hint``); ``supported_block_sizes`` (empty = any); ``supported_mla_dimensions``
    (``MLADimensions(kv_lora_rank=..., qk_rope_head_dim=...)``, empty = any, as prefill declares
    its own; ``supports_mla_dimensions(dims)`` reads them; the old ``supported_head_dims``
    pairs still work, deprecated); ``max_query_len``; ``isolates_nonfinite_keys`` (whether a
    non-finite key leaves the rows that do not see it alone inside a multi-token step; see the
    module docstring); ``validate_configuration`` lists every reason it cannot run.

    **Instance API**: ``__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim,
    kv_cache_dtype, *, device_capability=None, workspaces=None)``;
    ``prepare_metadata(metadata)`` once per step (an ``MLADecodeMetadata``:
    ``MLADecodeMetadata.build(block_table, seq_lens, query_len)``, ``block_table`` int32
    ``[B, max_blocks]``, ``seq_lens`` int32 ``[B]`` counting the step's new tokens,
    ``query_len`` an int 1..16 or one equal length per request; or, as a convenience, those
    three themselves: ``prepare_metadata(block_table, seq_lens, query_len)``), then the step
    hook ``_prepare_step(metadata)`` (plan kernels; the old name ``_plan`` still works,
    deprecated); ``run_decode(q, kv_cache, *,
    return_softmax_lse=False, out=None, k_scale=None, softmax_scale=None)`` per layer:
    ``q [B, query_len, H, kv_lora_rank + qk_rope_head_dim]``,
    ``kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` -> ``out [B,
    query_len, H, kv_lora_rank]`` (q's dtype), or ``(out, lse)`` with ``lse [H, B, query_len]``
    float32 natural log (``forward_decode(q, kv_cache, out=None, return_lse=False)``: the same
    with the old LSE layout ``[B, query_len, H]``). Semantics are in the module docstring.

    The base checks everything before a subclass's ``_run_decode`` sees it: a non-uniform
    batch, a block table narrower than ``seq_lens`` needs, a block id out of range, a cache of
    the wrong width, dtype, device or rank, a ``q`` whose batch/query_len/heads do not match
    the step, and non-finite or non-positive scales are ``ValueError``. An empty batch returns
    empty outputs without running a kernel.
    """

    #: Cache dtypes the kernels read.
    supported_dtypes: ClassVar[Sequence[torch.dtype]] = (torch.float16, torch.bfloat16)
    #: Cache block sizes the kernels accept; empty means any.
    supported_block_sizes: ClassVar[Sequence[int]] = ()
    #: MLA dimensions the kernels accept (``kv_lora_rank`` and ``qk_rope_head_dim`` are
    #: read); empty means any.
    supported_mla_dimensions: ClassVar[Sequence[MLADimensions]] = ()
    #: The same as ``(kv_lora_rank, qk_rope_head_dim)`` pairs: kept in step with
    #: ``supported_mla_dimensions`` (declaring it instead is deprecated).
    supported_head_dims: ClassVar[Sequence[tuple[int, int]]] = ()
    #: The largest uniform query length per request.
    max_query_len: ClassVar[int] = MAX_QUERY_LEN
    #: Whether a non-finite key leaves every row that does not see it untouched inside a
    #: multi-token step (False: other rows of the same request and step may turn non-finite,
    #: never finite and wrong; see the module docstring).
    isolates_nonfinite_keys: ClassVar[bool] = True
    #: Latent cache dtypes the kernels read (``app.config.KV_CACHE_DTYPES``); None: ``"auto"``,
    #: and ``"fp8"`` / ``"fp8_e4m3"`` where ``supported_dtypes`` has float8_e4m3fn (a backend
    #: written before cache dtypes had names). ``"fp8_ds_mla"`` only where declared.
    supported_kv_cache_dtypes: ClassVar[Sequence[str] | None] = None
    #: Why a cache dtype is not read, where there is more to say than "not supported" (the
    #: selection reasons append it).
    kv_cache_dtype_notes: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        check_own_verbs(cls, MLADecodeBackend)   # verbs of its own: checked as the base's
        if "_plan" in own:
            warnings.warn(f"{cls.__qualname__}._plan: the step hook is named _prepare_step "
                          f"now, for decode and prefill alike; _plan is still called, for now",
                          DeprecationWarning, stacklevel=3)
        if "supported_head_dims" in own and "supported_mla_dimensions" not in own:
            warnings.warn(f"{cls.__qualname__}.supported_head_dims: declare "
                          f"supported_mla_dimensions = (MLADimensions(kv_lora_rank=..., "
                          f"qk_rope_head_dim=...), ...) instead, as prefill does; "
                          f"supported_head_dims still works, for now", DeprecationWarning,
                          stacklevel=3)
            if _latent_pairs(own["supported_head_dims"]):  # else declaration_problems says so
                cls.supported_mla_dimensions = tuple(
                    MLADimensions(kv_lora_rank=rank, qk_rope_head_dim=rope)
                    for rank, rope in own["supported_head_dims"])
        elif "supported_mla_dimensions" in own and collection_of(
                lambda v: isinstance(v, MLADimensions))(own["supported_mla_dimensions"]):
            cls.supported_head_dims = tuple(d.latent_head_dims
                                            for d in own["supported_mla_dimensions"])

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """The base's problems, then those of ``supported_block_sizes``,
        ``supported_mla_dimensions`` (or the old ``supported_head_dims``), ``max_query_len``
        and ``isolates_nonfinite_keys``."""
        return (super().declaration_problems()
                + find_declaration_problems(cls, _DECODE_DECLARATIONS))

    @classmethod
    def kv_cache_dtypes(cls) -> tuple[str, ...]:
        """The cache dtype names this backend reads (``supported_kv_cache_dtypes``, or what
        its ``supported_dtypes`` imply; see there)."""
        if cls.supported_kv_cache_dtypes is not None:
            return tuple(cls.supported_kv_cache_dtypes)
        fp8 = torch.float8_e4m3fn in tuple(cls.supported_dtypes)
        return ("auto", "fp8", "fp8_e4m3") if fp8 else ("auto",)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool:
        """Whether the kernels read a latent cache of this dtype name (``"fp8"`` and
        ``"fp8_e4m3"`` are one)."""
        names = {canonical_kv_cache_dtype(n) for n in cls.kv_cache_dtypes()}
        try:
            return canonical_kv_cache_dtype(kv_cache_dtype) in names
        except (TypeError, ValueError):
            return False

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        """Whether the kernels read a cache of this block size (any, when the list is empty)."""
        return is_int(block_size) and block_size >= 1 and (
            not cls.supported_block_sizes or block_size in cls.supported_block_sizes)

    @classmethod
    def supports_mla_dimensions(cls, dims: MLADimensions) -> bool:
        """Whether ``dims.latent_head_dims`` (``(kv_lora_rank, qk_rope_head_dim)``, what decode
        reads) is one of ``supported_mla_dimensions``' (always, when that is empty)."""
        return not cls.supported_mla_dimensions or dims.latent_head_dims in {
            d.latent_head_dims for d in cls.supported_mla_dimensions}

    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLADecodeSelectorConfig) -> list[str]:
        """Every reason this backend cannot run here, in a fixed order: capability, dtype,
        availability, dimensions, block size, query_len, sparsity. An empty list means
        valid."""
        slots = cls.reason_slots(device_capability, selector_config)
        return [reason for reasons in slots.values() for reason in reasons]

    @classmethod
    def reason_slots(cls, device_capability: DeviceCapability | None,
                     selector_config: MLADecodeSelectorConfig) -> dict[str, list[str]]:
        """``validate_configuration``'s reasons by slot, in its order: ``capability``,
        ``dtype``, ``availability``, ``dimensions``, ``block_size``, ``query_len``,
        ``sparsity`` (dense or sparse attention: ``sparsity_reasons``; at most one reason in
        each). A backend with limits of its own adds them to a slot and flattens
        the lists, so that the order holds (FLASHINFER_MLA, TOKENSPEED_MLA)."""
        capability, dtypes, availability = cls.platform_reason_slots(device_capability,
                                                                     selector_config.dtype)
        dtypes += cls._kv_cache_dtype_reasons(selector_config)
        rank, rope = selector_config.kv_lora_rank, selector_config.qk_rope_head_dim
        dimensions: list[str] = []
        if not cls.supports_mla_dimensions(selector_config.mla_dimensions):
            supported = ", ".join(f"({d.kv_lora_rank}, {d.qk_rope_head_dim})"
                                  for d in cls.supported_mla_dimensions)
            dimensions.append(f"MLA dimensions (kv_lora_rank, qk_rope_head_dim) = ({rank}, "
                              f"{rope}) not supported (supported: {supported})")
        block_size: list[str] = []
        if not cls.supports_block_size(selector_config.block_size):
            sizes = ", ".join(str(s) for s in cls.supported_block_sizes)
            block_size.append(f"block size {selector_config.block_size} not supported "
                              f"(supported: {sizes})")
        query_len: list[str] = []
        if selector_config.query_len > cls.max_query_len:
            query_len.append(f"query_len {selector_config.query_len} exceeds the maximum "
                             f"{cls.max_query_len}")
        return {"capability": capability, "dtype": dtypes, "availability": availability,
                "dimensions": dimensions, "block_size": block_size, "query_len": query_len,
                "sparsity": cls.sparsity_reasons(getattr(selector_config, "index_topk", None))}

    def fp8_query(self) -> bool:
        """Whether the kernel reads the query quantised to e4m3 (one scale per call,
        ``amax / 448``) with this instance's cache dtype: the decode conformance kit's FP8
        bounds then take the query as the kernel sees it. False unless a backend says so
        (FLASHINFER_MLA's trtllm-gen and TOKENSPEED_MLA on an FP8 cache)."""
        return False

    @classmethod
    def _kv_cache_dtype_reasons(cls, selector_config: MLADecodeSelectorConfig) -> list[str]:
        """The reason for the ``dtype`` slot when the selector's cache dtype is not read."""
        name = selector_config.kv_cache_dtype
        if cls.supports_kv_cache_dtype(name):
            return []
        note = cls.kv_cache_dtype_notes.get(name) or cls.kv_cache_dtype_notes.get(
            canonical_kv_cache_dtype(name))
        return [f"kv_cache_dtype {name!r} not supported (reads: "
                f"{', '.join(cls.kv_cache_dtypes())}){': ' + note if note else ''}"]

    # -- the cache dtype of an instance (issue 36) -------------------------------------------

    def _set_kv_cache_dtype(self, name: str, kv_cache_dtype: object,
                            kv_lora_rank: int, qk_rope_head_dim: int) -> None:
        """``kv_cache_dtype`` (a torch dtype, or a cache dtype name: ``"fp8"`` /
        ``"fp8_e4m3"`` -> float8_e4m3fn, ``"fp8_ds_mla"`` -> uint8 rows of
        ``ds_mla_row_bytes``) -> ``self.kv_cache_dtype`` (the cache tensor's dtype),
        ``self.kv_cache_format`` (``"auto"``, ``"fp8_e4m3"``, ``"fp8_ds_mla"``) and
        ``self.kv_cache_row_width`` (the cache's last dim)."""
        head = kv_lora_rank + qk_rope_head_dim
        expected = ("a torch.dtype or a cache dtype name ('fp8', 'fp8_e4m3', "
                    "'fp8_ds_mla')")
        if isinstance(kv_cache_dtype, str):
            try:
                fmt = canonical_kv_cache_dtype(kv_cache_dtype)
            except ValueError:   # a dtype's name ('bf16'): a TypeError, as before names
                raise TypeError(f"{name}: kv_cache_dtype must be {expected}, got "
                                f"{kv_cache_dtype!r}") from None
            if fmt == "auto":
                raise ValueError(f"{name}: kv_cache_dtype 'auto' means the model's dtype, "
                                 f"which a backend is not told: pass that torch.dtype")
        elif isinstance(kv_cache_dtype, torch.dtype):
            fmt = "fp8_e4m3" if kv_cache_dtype == torch.float8_e4m3fn else "auto"
        else:
            raise TypeError(f"{name}: kv_cache_dtype must be {expected}, got "
                            f"{kv_cache_dtype!r}")
        if fmt == "auto":
            if not self.supports_dtype(kv_cache_dtype):  # type: ignore[arg-type]
                raise ValueError(f"{name}: kv_cache_dtype {kv_cache_dtype} not supported "
                                 f"(supported: {list(self.supported_dtypes)})")
            self.kv_cache_dtype: torch.dtype = kv_cache_dtype  # type: ignore[assignment]
            self.kv_cache_format, self.kv_cache_row_width = "auto", head
            return
        if not self.supports_kv_cache_dtype(fmt):
            raise ValueError(f"{name}: kv_cache_dtype {kv_cache_dtype!r} not supported "
                             f"(reads: {', '.join(self.kv_cache_dtypes())})")
        self.kv_cache_format = fmt
        if fmt == "fp8_ds_mla":
            try:
                self.kv_cache_row_width = ds_mla_row_bytes(kv_lora_rank, qk_rope_head_dim)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            self.kv_cache_dtype = torch.uint8
        else:
            self.kv_cache_row_width, self.kv_cache_dtype = head, torch.float8_e4m3fn

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int,
                 kv_cache_dtype: torch.dtype | str, *,
                 device_capability: DeviceCapability | None = None,
                 workspaces: WorkspaceSource | None = None) -> None:
        """``device_capability``: the GPU's compute capability, passed in by whoever builds the
        backend (the container, from its platform; None on a CPU). ``workspaces``: the
        container's kernel workspaces (None: a backend whose kernels need one makes its own).
        ``kv_cache_dtype``: the cache tensor's torch dtype, or a cache dtype name
        (``"fp8"``, ``"fp8_e4m3"``, ``"fp8_ds_mla"``: see ``app.kvcache.cache_dtypes``)."""
        name = type(self).__name__
        check_int_at_least(f"{name}: num_heads", num_heads, 1)
        check_int_at_least(f"{name}: kv_lora_rank", kv_lora_rank, 1)
        check_int_at_least(f"{name}: qk_rope_head_dim", qk_rope_head_dim, 0)
        self._set_kv_cache_dtype(name, kv_cache_dtype, kv_lora_rank, qk_rope_head_dim)
        if device_capability is not None and not isinstance(device_capability,
                                                            DeviceCapability):
            raise TypeError(f"{name}: device_capability must be a DeviceCapability or None, "
                            f"got {device_capability!r}")
        self.num_heads = num_heads
        self.scale = check_attention_scale(name, "scale", scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.device_capability = device_capability
        self.workspaces = workspaces
        self._metadata: MLADecodeMetadata | None = None

    @classmethod
    def from_config(cls, config: EngineConfig,
                    device_capability: DeviceCapability | None = None, *,
                    workspaces: WorkspaceSource | None = None) -> MLADecodeBackend:
        """An instance for ``config.model``'s shape, its cache dtype ``config.cache.
        kv_cache_dtype`` (``"auto"``: the model dtype), as the prefill base's ``from_config``:
        ``device_capability`` and ``workspaces`` are passed only when given, so a constructor
        without them still works."""
        m = config.model
        cache_dtype = canonical_kv_cache_dtype(config.cache.kv_cache_dtype)
        kv_dtype: torch.dtype | str = {"auto": m.dtype, "fp8_e4m3": torch.float8_e4m3fn}.get(
            cache_dtype, cache_dtype)
        extra: dict[str, Any] = {}
        if device_capability is not None:
            extra["device_capability"] = device_capability
        if workspaces is not None:
            extra["workspaces"] = workspaces
        return cls(num_heads=m.num_heads, scale=m.scale, kv_lora_rank=m.kv_lora_rank,
                   qk_rope_head_dim=m.qk_rope_head_dim, kv_cache_dtype=kv_dtype, **extra)

    def prepare_metadata(self, metadata: MLADecodeMetadata | torch.Tensor | None = None,
                         seq_lens: torch.Tensor | None = None,
                         query_len: int | Sequence[int] | torch.Tensor | None = None, *,
                         block_table: torch.Tensor | None = None) -> None:
        """Take the step's layout (checked here, once per step, reused by every layer), then
        ``_prepare_step`` (kernel plans).

        ``metadata``: an ``MLADecodeMetadata`` (``MLADecodeMetadata.build(block_table,
        seq_lens, query_len)``); its ``query_len`` must be at most this backend's
        ``max_query_len``. Or, as before, the three themselves: ``prepare_metadata(block_table,
        seq_lens, query_len)`` (``block_table`` int32 ``[B, max_blocks]``, ``seq_lens`` int32
        ``[B]`` including the step's new tokens, ``query_len`` uniform in
        1..``max_query_len``). A step refused by the checks leaves the previous one in place;
        one whose plans fail leaves no step."""
        what = f"{type(self).__name__}.prepare_metadata"
        if isinstance(metadata, MLADecodeMetadata):
            if seq_lens is not None or query_len is not None or block_table is not None:
                raise TypeError(f"{what}: pass an MLADecodeMetadata alone, or block_table, "
                                f"seq_lens and query_len (not both)")
            step = metadata.check_step(what, self.max_query_len)
        else:
            if block_table is not None and metadata is not None:
                raise TypeError(f"{what}: block_table given twice (positionally and by name)")
            step = MLADecodeMetadata.build(
                metadata if block_table is None else block_table, seq_lens, query_len,
                max_query_len=self.max_query_len, what=what)
        self._metadata = step
        try:
            self._prepare_step(step)
        except BaseException:
            self._metadata = None
            raise

    def _prepare_step(self, metadata: MLADecodeMetadata) -> None:
        """Hook: plan kernels for the step, from its checked metadata (default: the
        deprecated ``_plan``, which does nothing)."""
        self._plan(metadata)

    def _plan(self, metadata: MLADecodeMetadata) -> None:
        """The step hook's old name (deprecated: override ``_prepare_step``)."""

    @property
    def metadata(self) -> MLADecodeMetadata:
        """The metadata of the current step (``ValueError`` before ``prepare_metadata``)."""
        if self._metadata is None:
            raise ValueError(f"{type(self).__name__}: call prepare_metadata() before "
                             f"run_decode()")
        return self._metadata

    def run_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, *,
                   return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                   softmax_scale: float | None = None,
                   k_scale: float | torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Absorbed MLA decode of the step's queries over the paged cache.

        ``q [B, query_len, H, kv_lora_rank + qk_rope_head_dim]``, ``kv_cache [num_blocks,
        block_size, kv_lora_rank + qk_rope_head_dim]`` -> ``out [B, query_len, H,
        kv_lora_rank]`` in q's dtype (written into ``out=`` when given), and with
        ``return_softmax_lse`` ``(out, lse)``, ``lse [H, B, query_len]`` float32 natural log,
        contiguous: head-major like the prefill LSE ``[H, T]`` (viewed as ``[H, B * query_len]``
        its tokens are request-major, the rows of ``out.view(B * query_len, H, -1)``), so
        ``merge_attn_states`` takes it as is. ``softmax_scale`` defaults to the constructor's
        ``scale``; ``k_scale`` (cache dequantisation) to 1. Both are read on every call."""
        what = f"{type(self).__name__}.run_decode"
        check_return_flag(what, "return_softmax_lse", return_softmax_lse)
        target, lse = self._decode(what, q, kv_cache, out, softmax_scale, k_scale,
                                   return_softmax_lse)
        if lse is None:
            return target
        return target, lse.permute(2, 0, 1).contiguous()

    def forward_decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       out: torch.Tensor | None = None, return_lse: bool = False, *,
                       k_scale: float | torch.Tensor | None = None,
                       softmax_scale: float | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``run_decode`` in its old form (the verb TokenSpeed's vLLM backend names): the same
        checks and result, ``return_lse`` for ``return_softmax_lse``, and the LSE token-major,
        ``[B, query_len, H]`` float32 natural log (contiguous)."""
        what = f"{type(self).__name__}.forward_decode"
        check_return_flag(what, "return_lse", return_lse)
        if runs_its_own_decode(self):   # a class with its own run_decode and no _run_decode
            result = self.run_decode(q, kv_cache, return_softmax_lse=return_lse, out=out,
                                     softmax_scale=softmax_scale, k_scale=k_scale)
            if not isinstance(result, tuple):
                return result
            return result[0], result[1].permute(1, 2, 0).contiguous()
        target, lse = self._decode(what, q, kv_cache, out, softmax_scale, k_scale, return_lse)
        return target if lse is None else (target, lse)

    def run_sparse_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                          *, return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                          softmax_scale: float | None = None,
                          k_scale: float | torch.Tensor | None = None
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Sparse absorbed MLA decode (DeepSeek Sparse Attention): each query row attends only
        to the cache rows its indices name (a backend with ``supports_sparse``; ``TypeError``
        on one without).

        ``q [B, query_len, H, kv_lora_rank + qk_rope_head_dim]`` and ``kv_cache [num_blocks,
        block_size, kv_lora_rank + qk_rope_head_dim]`` as ``run_decode`` takes them (B and
        query_len from ``prepare_metadata``); ``indices [B, query_len, topk]`` int32: rows of
        the cache viewed flat (slot ``block_id * block_size + offset``, the indexer's positions
        through the request's block table: ``SparseIndexerMetadata.to_slots``), ``-1`` for
        padding, each in ``[-1, num_blocks * block_size)`` (``ValueError`` otherwise). Every
        entry is one softmax term (a slot named twice counts twice); a row whose entries are
        all ``-1`` gets out 0 and LSE ``-inf``. The indices are a per-layer argument: each
        layer's indexer selects its own. Returns what ``run_decode`` returns: ``out [B,
        query_len, H, kv_lora_rank]`` (q's dtype), with ``return_softmax_lse`` also ``lse [H,
        B, query_len]`` float32 natural log."""
        what = f"{type(self).__name__}.run_sparse_decode"
        check_return_flag(what, "return_softmax_lse", return_softmax_lse)
        target, lse = self._decode(what, q, kv_cache, out, softmax_scale, k_scale,
                                   return_softmax_lse, indices=indices)
        if lse is None:
            return target
        return target, lse.permute(2, 0, 1).contiguous()

    def _decode(self, what: str, q: torch.Tensor, kv_cache: torch.Tensor,
                out: torch.Tensor | None, softmax_scale: object, k_scale: object,
                want_lse: bool, *, indices: object = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The template of the verbs: checks, scales, ``out=``, the kernel hook (the sparse
        one when ``indices`` is given). Returns ``(out, lse [B, query_len, H] or None)``."""
        call = DecodeCall.check(self, what, q, kv_cache, out, softmax_scale, k_scale, indices)
        # An out= sharing memory with anything the kernel reads (q, the cache, the step's block
        # tables and lengths, the indices) is written after the kernel, never during it.
        target = call.target(out)
        # Kernels write the LSE token-major (next to their output rows).
        lse = torch.empty(call.shape[:3], dtype=torch.float32, device=call.q.device) \
            if want_lse else None
        hook: Callable[..., object]   # returns None (check_hook_result)
        if call.metadata.batch and call.indices is not None:
            hook = self._run_sparse_decode
            check_hook_result(self, "_run_sparse_decode", hook(
                call.metadata, call.q, call.kv_cache, call.indices, target, lse,
                call.softmax_scale, call.k_scale), target)
        elif call.metadata.batch:
            hook = self._run_decode
            check_hook_result(self, "_run_decode", hook(
                call.metadata, call.q, call.kv_cache, target, lse, call.softmax_scale,
                call.k_scale), target)
        if out is not None and target is not out:
            out.copy_(target)
            target = out
        return target, lse

    @abstractmethod
    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        """Run the kernel on checked inputs (B >= 1): write ``out [B, query_len, H,
        kv_lora_rank]`` (contiguous, q's dtype) and, when ``lse`` is not None, ``lse [B,
        query_len, H]`` (contiguous float32, natural log); return None (a returned tensor is a
        ``TypeError``: the base hands the caller ``out``). ``q`` may be non-contiguous."""

    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> None:
        """Run the sparse kernel on checked inputs (B >= 1; a backend with
        ``supports_sparse`` overrides it): ``indices [B, query_len, topk]`` int32 contiguous
        (the base's private checked copy, never the caller's tensor), every entry a row of
        ``kv_cache.view(-1, D)`` or -1; write ``out`` and ``lse`` as ``_run_decode`` does."""
        raise NotImplementedError(f"{type(self).__name__} declares supports_sparse but does "
                                  f"not implement _run_sparse_decode")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_heads={self.num_heads}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"kv_cache_dtype={self.kv_cache_dtype}"
                + (f", kv_cache_format={self.kv_cache_format!r}"
                   if self.kv_cache_format != "auto" else "") + ")")

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly description of the instance."""
        return {"name": self.get_name(), "class": f"{type(self).__module__}."
                f"{type(self).__qualname__}", "num_heads": self.num_heads,
                "kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                "kv_cache_dtype": str(self.kv_cache_dtype),
                "kv_cache_format": self.kv_cache_format}


class MLASparseDecodeBackend(MLADecodeBackend):
    """Base of a decode backend that runs sparse attention only (``supports_dense = False``):
    implement ``_run_sparse_decode``; the base refuses the dense verbs before any hook."""

    supports_dense: ClassVar[bool] = False
    supports_sparse: ClassVar[bool] = True

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        """Never called: the base refuses dense calls to a sparse-only backend."""
        raise NotImplementedError(f"{type(self).__name__} runs sparse attention only")

    @abstractmethod
    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> None:
        """The sparse kernel (see ``MLADecodeBackend._run_sparse_decode``)."""
