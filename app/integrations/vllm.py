"""Our TORCH_SDPA CPU prefill (the native kernel) behind vLLM's ``MLAPrefillBackend``.

:class:`AppCPUMLAPrefillBackend` implements vLLM's interface (``vllm.v1.attention.backends.
mla.prefill.base.MLAPrefillBackend``: a constructor taking ``vllm_config``, ``clone``,
``prepare_metadata``, ``run_prefill_new_tokens``, ``run_prefill_context_chunk``,
``validate_configuration``, ``supports_out`` ...) and runs our TORCH_SDPA backend class, resolved
through our container once per process (:meth:`AppCPUMLAPrefillBackend.backend_class`; an
engine with its own container binds it with :meth:`~AppCPUMLAPrefillBackend.bind_container`).

vLLM's prefill metadata is mapped onto our plan once per step, in ``prepare_metadata``: the new
tokens become one ``MLAPrefillMetadata`` (the prefill's ``query_start_loc``), and each of
vLLM's context chunks (a run of requests ``chunk.request_slice``, their queries
``q[chunk.token_slice]`` attending ``chunk.seq_lens`` cached tokens) becomes one more, each
prepared on its own instance of our backend (kept between steps), so every layer's calls of the
step reuse those plans. Tensors are vLLM's: ``q [T, H, P+R]``, ``k [T_kv, H, P+R]``,
``v [T_kv, H, V]`` (a split view is fine), output ``[T, H, V]`` in ``q``'s dtype, LSE
``[H, T]`` float32 natural log. ``out=`` is honoured by both calls (``supports_out()``).

vLLM imports this module by class path (``MLAPrefillBackendEnum.CPU``, set by the general
plugin in :mod:`app.integrations`); importing it needs vLLM (``ImportError`` otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

try:
    from vllm.v1.attention.backends.mla.prefill.base import (
        MLAPrefillBackend as VllmMLAPrefillBackend,
    )
except ImportError as _exc:  # pragma: no cover - exercised where vLLM is absent
    raise ImportError(f"app.integrations.vllm needs vLLM's MLA prefill backend base "
                      f"(vllm.v1.attention.backends.mla.prefill.base): {_exc}. Install vLLM "
                      f"(docs/vllm.md, 'Use inside vLLM')") from _exc

from app._types import MLADimensions
from app.backends.prefill.base import (
    MLAPrefillBackend,
    MLAPrefillMetadata,
    MLAPrefillSelectorConfig,
)
from app.integrations import _vllm_backends
from app.integrations._vllm_plugin import announce_pending

if TYPE_CHECKING:
    from app.containers import Application

__all__ = ["AppCPUMLAPrefillBackend"]


def _host_query_lens(prefill_metadata: Any) -> list[int]:
    """Each prefill request's new-token count, from host data (no device sync)."""
    lens = getattr(prefill_metadata, "query_lens_cpu", None)
    if lens is None:
        start_loc = _field(prefill_metadata, "query_start_loc")
        lens = torch.diff(start_loc.to("cpu", torch.int64))
    return [int(n) for n in lens.tolist()]


def _field(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise TypeError(f"AppCPUMLAPrefillBackend: vLLM's {type(obj).__name__} has no "
                        f"{name!r} (this integration was written against vLLM 0.32's CPU "
                        f"build)") from None


class AppCPUMLAPrefillBackend(VllmMLAPrefillBackend):  # type: ignore[misc,unused-ignore]
    """vLLM's CPU MLA prefill backend replaced by our TORCH_SDPA CPU path (native kernel).

    Built by vLLM once per attention layer (and ``clone``-d per metadata builder); gets
    ``prepare_metadata`` once per step, then the causal new-token call and one call per context
    chunk for every layer. Runs on CPU only (``validate_configuration`` says why not on a GPU).
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                      torch.float32]
    #: Our backend class this adapter runs, resolved through a container once per process.
    _backend_cls: ClassVar[type[MLAPrefillBackend] | None] = None

    @staticmethod
    def get_name() -> str:
        """``"APP_TORCH_SDPA_CPU"`` (what vLLM logs as the MLA prefill backend in use)."""
        return "APP_TORCH_SDPA_CPU"

    @classmethod
    def backend_class(cls) -> type[MLAPrefillBackend]:
        """Our TORCH_SDPA class: resolved through the active container on the first call in
        the process (the plugin makes that call at vLLM's start-up), then kept."""
        return _vllm_backends.prefill_backend_class()

    @classmethod
    def bind_container(cls, container: Application) -> type[MLAPrefillBackend]:
        """Resolve our TORCH_SDPA class through ``container`` now and keep it (an engine that
        builds its own container calls this once at start-up; instances built later use it)."""
        _vllm_backends.bind_container(container, "prefill")
        return _vllm_backends.prefill_backend_class()

    @classmethod
    def describe_backend(cls) -> str:
        """Our prefill class and the CPU kernel it runs here (native, or aten's and why)."""
        return _vllm_backends.describe_prefill()

    @classmethod
    def is_available(cls) -> bool:
        """Always: torch's CPU kernels are the fallback of the native one."""
        return True

    @classmethod
    def supports_compute_capability(cls, device_capability: Any) -> bool:
        """Only on CPU (vLLM's capability is None there)."""
        return device_capability is None

    @classmethod
    def validate_configuration(cls, device_capability: Any, selector_config: Any) -> list[str]:
        """vLLM's checks (capability, dtype, availability, dimensions), then our backend's own
        reasons for vLLM's dtype and MLA dimensions; empty means valid."""
        reasons: list[str] = list(super().validate_configuration(device_capability,
                                                                 selector_config))
        if device_capability is not None:
            return reasons
        dims = selector_config.mla_dimensions
        ours = cls.backend_class().validate_configuration(None, MLAPrefillSelectorConfig(
            dtype=selector_config.dtype, mla_dimensions=MLADimensions(
                dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim)))
        return reasons + [r for r in ours if r not in reasons]

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, vllm_config: Any) -> None:
        super().__init__(num_heads=num_heads, scale=scale, kv_lora_rank=kv_lora_rank,
                         qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                         v_head_dim=v_head_dim, vllm_config=vllm_config)
        announce_pending()
        self._backend = self.backend_class()
        self._new_tokens = self._make_backend()
        self._chunk_backends: list[MLAPrefillBackend] = []
        self._chunks: dict[int, tuple[Any, MLAPrefillBackend]] = {}

    def _make_backend(self) -> MLAPrefillBackend:
        return self._backend(num_heads=self.num_heads, scale=self.scale,
                             kv_lora_rank=self.kv_lora_rank,
                             qk_nope_head_dim=self.qk_nope_head_dim,
                             qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)

    def supports_out(self) -> bool:
        """True: both calls write a given ``out [T, H, V]`` in place and return it."""
        return True

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        """Map vLLM's ``MLACommonPrefillMetadata`` onto our plans, once per step: the new
        tokens, and each context chunk of ``prefill_metadata.chunked_context``."""
        super().prepare_metadata(prefill_metadata)
        query_lens = _host_query_lens(prefill_metadata)
        device = _field(prefill_metadata, "query_start_loc").device
        self._chunks = {}
        self._new_tokens.prepare_metadata(MLAPrefillMetadata.build(query_lens, device=device))
        chunked = _field(prefill_metadata, "chunked_context")
        chunks = list(_field(chunked, "chunks")) if chunked is not None else []
        while len(self._chunk_backends) < len(chunks):
            self._chunk_backends.append(self._make_backend())
        for chunk, backend in zip(chunks, self._chunk_backends, strict=False):
            requests = _field(chunk, "request_slice")
            seq_lens = [int(n) for n in _field(chunk, "seq_lens").tolist()]
            backend.prepare_metadata(MLAPrefillMetadata.build(
                query_lens[requests], [seq_lens], device=device))
            self._chunks[_field(chunk, "index")] = (chunk, backend)

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None,
                               output_scale: torch.Tensor | None = None
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens: ``out [T, H, V]`` (and ``lse [H, T]`` float32
        with ``return_softmax_lse``). ``output_scale`` (fused FP8 output) is a ``ValueError``:
        ``supports_quant_output`` is False, so vLLM never passes one."""
        if output_scale is not None:
            raise ValueError(f"{self.get_name()}: fused quantized output (output_scale) is not "
                             f"supported, got a tensor of shape {list(output_scale.shape)}")
        return self._new_tokens.run_prefill_new_tokens(q, k, v, return_softmax_lse, out=out)

    def run_prefill_context_chunk(self, chunk: Any, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of ``q[chunk.token_slice]`` over the chunk's cached tokens
        (``k``, ``v``): ``(out [T_chunk, H, V], lse [H, T_chunk] float32)``."""
        index = getattr(chunk, "index", None)
        entry = self._chunks.get(index) if isinstance(index, int) else None
        if entry is None or entry[0] is not chunk:
            raise ValueError(f"{self.get_name()}: context chunk {index!r} is not one of the "
                             f"{len(self._chunks)} chunk(s) of the metadata given to "
                             f"prepare_metadata() for this step")
        return entry[1].run_prefill_context_chunk(0, q, k, v, out=out)
