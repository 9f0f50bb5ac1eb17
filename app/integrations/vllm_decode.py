"""Our CPU_MLA decode behind vLLM's ``AttentionBackendEnum.CPU_MLA`` (vLLM 0.32's CPU build).

vLLM's CPU MLA backend runs decode through ``torch.ops._C.mla_decode_kvcache``, compiled for head
size 576 (``kv_lora_rank`` 512 + rope 64) and block size 16 only, without an LSE. Its classes
here keep everything else of vLLM's (the KV-cache write, the prefill through vLLM's prefill
registry, vLLM's ``forward_impl`` around them) and run the decode on our CPU_MLA backend
(resolved through our container once per process: :mod:`app.integrations._vllm_backends`):

- :class:`AppCPUMLAMetadataBuilder` (one per KV-cache group, built by vLLM once) owns one
  instance of our decode backend. Once per step, in ``build``, it maps vLLM's decode metadata
  (``block_table`` int32 ``[B, max_blocks]``, ``seq_lens`` int32 ``[B]``, the step's uniform
  query length ``num_decode_tokens / num_decodes``) onto our plan with ``prepare_metadata``, and
  hands that prepared backend to every layer in the step's :class:`AppMLADecodeMetadata`.
- :class:`AppCPUMLAImpl` (one per layer): ``forward_mqa`` runs that backend's ``run_decode`` on
  vLLM's latent cache in place: ``q [B * query_len, H, kv_lora_rank + rope]`` (or vLLM's
  ``(ql_nope, q_pe)`` pair), ``kv_c_and_k_pe_cache [num_blocks, block_size, kv_lora_rank +
  rope]`` (our cache layout: no copy), output ``[B * query_len, H, kv_lora_rank]`` in q's dtype.
- :class:`AppCPUMLABackend` declares what that supports: any block size, any head size
  ``kv_lora_rank + rope`` with ``kv_lora_rank`` a multiple of 64 and ``rope`` of 32 (checked
  exactly when a layer is built), fp16 / bf16 / fp32. vLLM's CPU platform still forces block
  size 16 for CPU_MLA (``CpuPlatform.check_and_update_config``); the head-size limits of vLLM's
  own MLA metadata (320, 512, 576) are lifted by :class:`AppMLAMetadata`.

**FP8 latent caches** (issue 36): vLLM's CPU build cannot keep an FP8 MLA cache: with
``kv_cache_dtype="fp8"`` its ``CPUMLAImpl.do_kv_cache_update`` casts the latent to the cache's
dtype without its scale and ``torch.ops._C.mla_decode_kvcache`` then refuses the cache
("expected scalar type BFloat16 but found Float8_e4m3fn"); with ``"fp8_ds_mla"`` the write
fails at once (``kv_cache.view(-1, 576)`` of 656-byte rows). Ours writes and reads both:
:meth:`AppCPUMLAImpl.do_kv_cache_update` quantises each new token's latent once, as this
package's engine does (``app.kvcache.cache_dtypes``: ``fp8`` / ``fp8_e4m3`` with the layer's
``k_scale``, the value vLLM keeps in ``layer._k_scale``, a finite value beyond ``448 x
k_scale`` saturated and logged; ``fp8_ds_mla``: DeepSeek's FlashMLA row, a power-of-two scale
per 128 values), into vLLM's uint8 cache in place; the decode reads the rows as they are
(CPU_MLA's FP8 paths). vLLM's CPU platform runs no chunked prefill or prefix caching for MLA,
so no prefill reads the cache back.

``get_name()`` stays ``"CPU_MLA"``: vLLM selected that name. vLLM imports this module by class
path once the general plugin has registered it; importing it needs vLLM (``ImportError``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import torch

try:
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonDecodeMetadata,
        MLACommonMetadata,
        MLACommonMetadataBuilder,
    )
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
except ImportError as _exc:  # pragma: no cover - exercised where vLLM is absent
    raise ImportError(f"app.integrations.vllm_decode needs vLLM's CPU MLA backend "
                      f"(vllm.v1.attention.backends.mla.cpu_mla): {_exc}. Install vLLM's CPU "
                      f"build (docs/vllm.md, 'Use inside vLLM')") from _exc

from app._types import MLADimensions
from app.backends.decode.base import MLADecodeBackend
from app.integrations import _vllm_backends
from app.integrations._vllm_plugin import announce_pending
from app.kvcache.cache_dtypes import quantize_fp8_ds_mla, quantize_fp8_per_layer

__all__ = ["AppCPUMLABackend", "AppCPUMLAImpl", "AppCPUMLAMetadataBuilder",
           "AppMLADecodeMetadata", "AppMLAMetadata"]

logger = logging.getLogger("vllm.plugins.app")


def _fp8_name(kv_cache_dtype: object) -> str | None:
    """``"fp8"`` or ``"fp8_ds_mla"`` for vLLM's FP8 cache dtype names we serve, else None."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "fp8"
    return "fp8_ds_mla" if kv_cache_dtype == "fp8_ds_mla" else None


def _cache_dtype_of(spec: Any) -> torch.dtype | str:
    """Our decode backend's ``kv_cache_dtype`` for vLLM's KV-cache spec (its
    ``cache_dtype_str`` names an FP8 cache; vLLM stores both as uint8)."""
    return _fp8_name(getattr(spec, "cache_dtype_str", None)) or spec.dtype


def _head_size_ok(head_size: int) -> bool:
    """``kv_lora_rank + rope`` can be a supported pair: at least 64, a multiple of 32."""
    return isinstance(head_size, int) and head_size >= 64 and head_size % 32 == 0


@dataclasses.dataclass
class AppMLADecodeMetadata(MLACommonDecodeMetadata):  # type: ignore[misc,unused-ignore]
    """vLLM's decode metadata plus ``backend``: our decode backend, its step prepared."""

    backend: MLADecodeBackend | None = None


@dataclasses.dataclass
class AppMLAMetadata(MLACommonMetadata[AppMLADecodeMetadata]):  # type: ignore[misc,unused-ignore]
    """vLLM's MLA metadata; its head-size check is our decode's, not vLLM's 320/512/576."""

    def __post_init__(self) -> None:
        if self.head_dim is not None and not _head_size_ok(self.head_dim):
            raise ValueError(f"head size {self.head_dim} (kv_lora_rank + qk_rope_head_dim) is "
                             f"not supported by our CPU MLA decode: expected a multiple of 32, "
                             f"at least 64")


class AppCPUMLAMetadataBuilder(MLACommonMetadataBuilder):  # type: ignore[misc,unused-ignore]
    """vLLM's MLA metadata builder; maps each step's decode metadata onto our plan once."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device, metadata_cls: type[Any] | None = None,
                 supports_dcp_with_varlen: bool = False) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                         metadata_cls=metadata_cls or AppMLAMetadata,
                         supports_dcp_with_varlen=supports_dcp_with_varlen)
        announce_pending()
        dims = self.mla_dims
        self.decode_backend: MLADecodeBackend = _vllm_backends.decode_backend_class()(
            num_heads=self.num_heads,
            scale=(dims.qk_nope_head_dim + dims.qk_rope_head_dim) ** -0.5,
            kv_lora_rank=dims.kv_lora_rank, qk_rope_head_dim=dims.qk_rope_head_dim,
            kv_cache_dtype=_cache_dtype_of(self.kv_cache_spec))

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> AppMLAMetadata:
        """vLLM's metadata; its decode part carries our backend with this step's plan."""
        metadata: AppMLAMetadata = super().build(common_prefix_len, common_attn_metadata,
                                                 fast_build)
        decode = metadata.decode
        if decode is not None:
            requests, tokens = metadata.num_decodes, metadata.num_decode_tokens
            if tokens % requests:
                raise ValueError(f"our CPU MLA decode needs a uniform query length per "
                                 f"request, got {tokens} decode tokens for {requests} requests")
            self.decode_backend.prepare_metadata(decode.block_table, decode.seq_lens,
                                                 tokens // requests)
            fields = {f.name: getattr(decode, f.name) for f in dataclasses.fields(decode)}
            fields["backend"] = self.decode_backend
            metadata.decode = AppMLADecodeMetadata(**fields)
        return metadata


class AppCPUMLAImpl(CPUMLAImpl):  # type: ignore[misc,unused-ignore]
    """vLLM's CPU MLA impl with its decode (``forward_mqa``) run by our CPU_MLA backend."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        announce_pending()
        decode = _vllm_backends.decode_backend_class()
        if not decode.supports_mla_dimensions(MLADimensions(
                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)):
            raise ValueError(f"our {decode.get_name()} decode does not support kv_lora_rank "
                             f"{self.kv_lora_rank} with qk_rope_head_dim "
                             f"{self.qk_rope_head_dim} ({decode.__qualname__}: kv_lora_rank a "
                             f"multiple of 64, qk_rope_head_dim of 32)")

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any, layer: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode ``q [B * query_len, H, kv_lora_rank + rope]`` (or ``(ql_nope, q_pe)``) over
        the paged latent cache in place: ``(out [B * query_len, H, kv_lora_rank], None)``."""
        decode = getattr(attn_metadata, "decode", None)
        backend = getattr(decode, "backend", None)
        if not isinstance(backend, MLADecodeBackend):
            raise TypeError(f"{type(self).__name__}.forward_mqa: expected the decode metadata "
                            f"of AppCPUMLAMetadataBuilder (with our prepared backend), got "
                            f"{type(decode).__name__}")
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        step = backend.metadata
        cache, k_scale = kv_c_and_k_pe_cache, None
        fmt = _fp8_name(self.kv_cache_dtype)
        if fmt is not None:   # vLLM's uint8 (or float8) bytes, read as our FP8 rows
            cache = cache.view(torch.uint8).view(
                torch.float8_e4m3fn if fmt == "fp8" else torch.uint8)
            k_scale = float(layer._k_scale) if fmt == "fp8" else None
        out = backend.run_decode(q.view(step.batch, step.query_len, *q.shape[1:]),
                                 cache, softmax_scale=self.scale, k_scale=k_scale)
        if not isinstance(out, torch.Tensor):  # only with return_softmax_lse
            raise TypeError(f"{type(backend).__name__}.run_decode returned {type(out)}")
        return out.view(step.batch * step.query_len, *out.shape[2:]), None


    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """vLLM's write for its own cache dtypes; an FP8 one quantised by ours (see the
        module docstring), slots of -1 (padding) skipped as vLLM skips them."""
        fmt = _fp8_name(kv_cache_dtype)
        if fmt is None:
            super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping,
                                       kv_cache_dtype, k_scale)
            return
        if kv_cache.numel() == 0:
            return
        latent = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
        slots = slot_mapping.flatten().to(torch.long)
        valid = slots >= 0
        if not bool(valid.all()):
            slots, latent = slots[valid], latent[valid]
        if fmt == "fp8_ds_mla":
            rows = quantize_fp8_ds_mla(latent, self.kv_lora_rank)
        else:
            q8, overflow = quantize_fp8_per_layer(latent, float(k_scale))
            rows = q8.view(torch.uint8)
            if int(overflow):
                logger.warning("app: %d latent value(s) beyond 448 x k_scale (%g) were "
                               "saturated in vLLM's fp8 KV cache", int(overflow),
                               float(k_scale))
        flat = kv_cache.view(torch.uint8).view(-1, rows.shape[-1])
        flat.index_copy_(0, slots, rows)


class AppCPUMLABackend(CPUMLABackend):  # type: ignore[misc,unused-ignore]
    """vLLM's CPU_MLA backend with our decode: any block size, head sizes beyond 576. Its name
    is vLLM's own (``get_name()`` is inherited: ``"CPU_MLA"``, the name vLLM selected; the
    plugin's log line says it is ours)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                      torch.float32]
    #: vLLM's cache dtype names: the model's, and the FP8 caches our write and decode serve.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"]

    @staticmethod
    def get_impl_cls() -> type[AppCPUMLAImpl]:
        """:class:`AppCPUMLAImpl`."""
        return AppCPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AppCPUMLAMetadataBuilder]:
        """:class:`AppCPUMLAMetadataBuilder`."""
        return AppCPUMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Empty (any, by vLLM's convention): :meth:`supports_head_size` decides."""
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """``kv_lora_rank + rope`` of at least 64, a multiple of 32 (the exact pair is
        checked when a layer is built)."""
        return _head_size_ok(head_size)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        """Any block size (our kernel reads the cache through the block table)."""
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Any positive block size (None: not chosen yet)."""
        return block_size is None or (isinstance(block_size, int) and block_size >= 1)
