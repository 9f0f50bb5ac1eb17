"""The MLA prefill backend contract: ``MLAPrefillBackend`` and its metadata.

Prefill attention after MLA's latent up-projection is ragged multi-head attention:

- ``q: [total_q, num_heads, qk_head_dim]`` (``qk_head_dim = qk_nope + qk_rope``, DeepSeek 192),
- ``k: [total_kv, num_heads, qk_head_dim]``, ``v: [total_kv, num_heads, v_head_dim]`` (DeepSeek
  128; ``v`` may be a non-contiguous view),
- output ``[total_q, num_heads, v_head_dim]`` in ``q``'s dtype (a backend may document another),
- LSE ``[num_heads, total_q]``, float32, **natural log**, contiguous; rows that see no key have
  LSE ``-inf`` and output 0.

New tokens attend causally (bottom-right aligned when ``q_len != kv_len``); each chunk of cached
context is attended without a mask, and the partial results are merged by LSE.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from app._types import DeviceCapability, MLADimensions
from app._validation import (
    FLOAT32_TINY,
    INT32_MAX,
    MAX_ATTENTION_SCALE,
    check_int_at_least,
    is_int,
)
from app.backends.declarations import (
    BackendDeclarations,
    DeclarationRule,
    collection_of,
    find_declaration_problems,
)

if TYPE_CHECKING:
    from app.backends.workspaces import KernelWorkspaces
    from app.config import EngineConfig

__all__ = [
    "R1_MLA_DIMENSIONS",
    "ContextChunkMetadata",
    "MLAPrefillBackend",
    "MLAPrefillMetadata",
    "MLAPrefillSelectorConfig",
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


@attrs.frozen
class MLAPrefillSelectorConfig:
    """What the selector needs to know about the model: its dtype and MLA dimensions."""

    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))
    mla_dimensions: MLADimensions = attrs.field(
        validator=attrs.validators.instance_of(MLADimensions))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> MLAPrefillSelectorConfig:
        """The selector config of an ``EngineConfig``'s model."""
        return cls(dtype=config.model.dtype, mla_dimensions=config.model.mla_dimensions)


def _cu_seqlens(lengths: Sequence[int], what: str) -> torch.Tensor:
    for i, n in enumerate(lengths):
        check_int_at_least(f"{what}[{i}]", n, 0)
    # The prefix sums are int32 (the kernels' layout): refuse what would wrap around.
    if sum(lengths) > INT32_MAX:
        raise ValueError(f"{what}: {sum(lengths)} tokens in all; the int32 prefix sums hold at "
                         f"most {INT32_MAX} (2**31 - 1)")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return cu


@attrs.frozen
class ContextChunkMetadata:
    """One chunk of cached context, per request: ``cu_seqlens_kv [B+1]`` int32 prefix sums."""

    cu_seqlens_kv: torch.Tensor
    cu_seqlens_kv_cpu: torch.Tensor
    max_seq_len_kv: int
    total_kv: int


@attrs.frozen
class MLAPrefillMetadata:
    """The ragged layout of one prefill step, shared by every layer of the step.

    ``cu_seqlens_q [B+1]`` int32: new tokens per request. ``cu_seqlens_kv_new [B+1]``: keys
    each request's new tokens attend causally (equal to ``cu_seqlens_q`` unless built with
    ``new_kv_lens``). ``context_chunks``: the chunks of cached context. Each tensor exists on
    the device (for kernels) and on the host (``*_cpu``, read without a device sync).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_cpu: torch.Tensor
    max_query_len: int
    total_q: int
    cu_seqlens_kv_new: torch.Tensor
    cu_seqlens_kv_new_cpu: torch.Tensor
    max_new_kv_len: int
    total_new_kv: int
    context_chunks: tuple[ContextChunkMetadata, ...] = ()

    @property
    def num_requests(self) -> int:
        """The batch size B."""
        return int(self.cu_seqlens_q_cpu.numel()) - 1

    @classmethod
    def build(cls, query_lens: Sequence[int],
              context_chunk_lens: Sequence[Sequence[int]] = (),
              device: torch.device | str = "cpu",
              new_kv_lens: Sequence[int] | None = None) -> MLAPrefillMetadata:
        """Build from host lengths: ``query_lens[b]`` new tokens of request b, and for each
        context chunk ``c``, ``context_chunk_lens[c][b]`` cached tokens of request b in it.

        ``new_kv_lens[b]`` (default ``query_lens[b]``) lets the causal call see more keys than
        queries (bottom-right aligned). Raises ``ValueError`` on negative or mismatched lengths.
        """
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:   # torch's "Invalid device string"
            raise ValueError(f"MLAPrefillMetadata.build: device must be a torch.device or a "
                             f"device string ('cpu', 'cuda:0'), got {device!r}") from exc
        cu_q_cpu = _cu_seqlens(query_lens, "query_lens")
        batch = len(query_lens)
        if new_kv_lens is None:
            new_kv_lens = query_lens
        if len(new_kv_lens) != batch:
            raise ValueError(f"new_kv_lens has {len(new_kv_lens)} entries, expected {batch}")
        cu_kv_cpu = _cu_seqlens(new_kv_lens, "new_kv_lens")
        chunks = []
        for c, lens in enumerate(context_chunk_lens):
            if len(lens) != batch:
                raise ValueError(f"context_chunk_lens[{c}] has {len(lens)} entries, "
                                 f"expected {batch} (one per request)")
            cu = _cu_seqlens(lens, f"context_chunk_lens[{c}]")
            chunks.append(ContextChunkMetadata(
                cu_seqlens_kv=cu.to(device), cu_seqlens_kv_cpu=cu,
                max_seq_len_kv=max(lens, default=0), total_kv=int(cu[-1])))
        return cls(
            cu_seqlens_q=cu_q_cpu.to(device), cu_seqlens_q_cpu=cu_q_cpu,
            max_query_len=max(query_lens, default=0), total_q=int(cu_q_cpu[-1]),
            cu_seqlens_kv_new=cu_kv_cpu.to(device), cu_seqlens_kv_new_cpu=cu_kv_cpu,
            max_new_kv_len=max(new_kv_lens, default=0), total_new_kv=int(cu_kv_cpu[-1]),
            context_chunks=tuple(chunks))


class MLAPrefillBackend(BackendDeclarations):
    """Base class of every MLA prefill backend (built-in or third party).

    A subclass declares what it supports with class attributes and classmethods; the selector
    asks ``validate_configuration`` for the reasons it cannot run (empty = valid). An instance
    is built once per layer shape, gets ``prepare_metadata`` once per step, and then runs the
    causal new-token attention and one non-causal call per context chunk.
    """

    #: MLA dimensions the kernels accept; empty means any.
    supported_mla_dimensions: ClassVar[Sequence[MLADimensions]] = ()
    #: vLLM's declaration: the kernels need DeepSeek R1's dimensions (128, 64, 128).
    requires_r1_mla_dimensions: ClassVar[bool] = False
    #: Whether ``out=`` is honoured (the kernel writes in place).
    supports_out: ClassVar[bool] = False

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
        availability, dimensions. An empty list means valid."""
        reasons = cls.platform_reasons(device_capability, selector_config.dtype)
        dims = selector_config.mla_dimensions
        if not cls.supports_mla_dimensions(dims):
            supported = ", ".join(str(d) for d in (
                cls.supported_mla_dimensions or [R1_MLA_DIMENSIONS]))
            reasons.append(f"Model does not have supported MLA dimensions "
                           f"(got {dims}; supported: {supported})")
        return reasons

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        """``device_capability``: the GPU's compute capability, passed in by whoever builds the
        backend (the container, from its platform; None on a CPU): a backend never asks
        ``torch.cuda`` for it at launch. ``workspaces``: the container's kernel workspaces
        (None: the backend makes its own when a kernel needs one)."""
        if device_capability is not None and not isinstance(device_capability, DeviceCapability):
            raise TypeError(f"{type(self).__name__}: device_capability must be a "
                            f"DeviceCapability or None, got {device_capability!r}")
        for name, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            check_int_at_least(f"{type(self).__name__}: {name}", value, 0)
        if num_heads < 1 or v_head_dim < 1 or qk_nope_head_dim + qk_rope_head_dim < 1:
            raise ValueError(f"{type(self).__name__}: num_heads, v_head_dim and the qk head dim "
                             f"must be >= 1, got {num_heads}, {v_head_dim}, "
                             f"{qk_nope_head_dim + qk_rope_head_dim}")
        try:  # nan, inf, a bool, a huge int and a non-number all fail
            scale_value = (math.nan if isinstance(scale, bool) or not isinstance(
                scale, (int, float)) else float(scale))
        except OverflowError:
            scale_value = math.nan
        if not FLOAT32_TINY <= scale_value <= MAX_ATTENTION_SCALE:
            raise ValueError(f"{type(self).__name__}: scale must be a positive, finite float in "
                             f"[{FLOAT32_TINY:.4g}, {MAX_ATTENTION_SCALE:.4g}] (the kernels "
                             f"multiply by it, and by log2(e), in float32), got {scale!r}")
        self.num_heads = num_heads
        self.scale = scale_value
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.config = config
        self.device_capability = device_capability
        self.workspaces = workspaces
        self._metadata: MLAPrefillMetadata | None = None

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

    def prepare_metadata(self, prefill_metadata: MLAPrefillMetadata) -> None:
        """Take the step's layout; backends plan their kernels here (once per step)."""
        self._metadata = self._checked_metadata(prefill_metadata)

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

    @abstractmethod
    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens.

        ``q: [total_q, H, qk_head_dim]``, ``k: [total_new_kv, H, qk_head_dim]``,
        ``v: [total_new_kv, H, v_head_dim]``. Returns ``out [total_q, H, v_head_dim]``, and
        with ``return_softmax_lse`` also ``lse [H, total_q]`` float32, natural log.
        """

    @abstractmethod
    def run_prefill_context_chunk(self, chunk: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of the new tokens over context chunk ``chunk``.

        ``q: [total_q, H, qk_head_dim]``, ``k: [chunk.total_kv, H, qk_head_dim]``,
        ``v: [chunk.total_kv, H, v_head_dim]``. Returns ``(out [total_q, H, v_head_dim],
        lse [H, total_q] float32 natural log)``; a request with an empty chunk gets LSE -inf.
        """

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_heads={self.num_heads}, "
                f"qk_head_dim={self.qk_head_dim}, v_head_dim={self.v_head_dim})")

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly description of the instance."""
        return {"name": self.get_name(), "class": f"{type(self).__module__}."
                f"{type(self).__qualname__}", "num_heads": self.num_heads,
                "qk_head_dim": self.qk_head_dim, "v_head_dim": self.v_head_dim}
