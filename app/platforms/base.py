"""The ``Platform`` base: what a device supports and prefers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

import torch

from app._types import DeviceCapability, MLADimensions

if TYPE_CHECKING:
    from app.config import EngineConfig


class SupportsMLADimensions(Protocol):
    """Anything with the model's MLA dimensions and dtype (``MLAPrefillSelectorConfig``)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def mla_dimensions(self) -> MLADimensions: ...


def wants_sparse(selector_config: object) -> bool:
    """Whether a selector config is a sparse model's (its ``index_topk`` is set): platforms
    then list their backends that run DeepSeek Sparse Attention."""
    return getattr(selector_config, "index_topk", None) is not None


class Platform(ABC):
    """A kind of device: its capability, its backend preferences and its KV-cache spec hook.

    Subclass it to describe new hardware; a platform plugin returns the subclass's dotted path.
    """

    #: Short name shown to users (``"cpu"``, ``"cuda"``).
    name: str = ""
    #: The torch device type tensors live on.
    device_type: str = "cpu"

    @abstractmethod
    def get_device_capability(self) -> DeviceCapability | None:
        """The device's compute capability, or None where the notion does not apply (CPU)."""

    @abstractmethod
    def mla_prefill_backend_priorities(self, selector_config: SupportsMLADimensions) -> list[str]:
        """Backend names in the order the selector should try them for this model."""

    def mla_decode_backend_priorities(self, selector_config: Any) -> list[str]:
        """Decode backend names in the order the selector should try them for this model
        (``selector_config``: an ``MLADecodeSelectorConfig``; its ``query_len`` matters).
        Default: ``TORCH_SDPA``, which runs on any device (``TORCH_SPARSE`` for a sparse
        model)."""
        return ["TORCH_SPARSE"] if wants_sparse(selector_config) else ["TORCH_SDPA"]

    def register_custom_kv_cache_specs(  # noqa: B027 - a hook, deliberately a no-op
            self, registry: Any, config: EngineConfig | None) -> None:
        """Hook: register this platform's own KV-cache spec kinds on ``registry`` (the
        container's ``KVCacheSpecBindings``).

        Runs once per container, after the built-in specs are registered. No-op by default.
        vLLM's form, a classmethod ``register_custom_kv_cache_specs(cls, vllm_config)`` that
        registers through ``KVCacheSpecRegistry.register``, works too: it is called with the
        config alone, and its registrations land in the container being set up.
        """

    def has_fast_bfloat16(self) -> bool:
        """Whether bf16 matmuls run natively fast (if not, kernels compute in float32)."""
        return True

    @property
    def device(self) -> torch.device:
        """The torch device of this platform."""
        return torch.device(self.device_type)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for ``python -m app platform``."""
        cap = self.get_device_capability()
        return {
            "platform": self.name,
            "platform_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "device_type": self.device_type,
            "device_capability": None if cap is None else str(cap),
            "fast_bfloat16": self.has_fast_bfloat16(),
        }

    def __repr__(self) -> str:
        cap = self.get_device_capability()
        return f"{type(self).__name__}(device_capability={cap})"
