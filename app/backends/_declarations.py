"""What every attention backend kind declares about itself, shared by the prefill and decode
bases: dtypes, GPU capability, availability, and the first three reasons of
``validate_configuration`` (capability, dtype, availability, in that order)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from app._types import DeviceCapability

__all__ = ["DEFAULT_UNAVAILABLE_REASON", "BackendDeclarations"]

DEFAULT_UNAVAILABLE_REASON = "required dependencies not available"


class BackendDeclarations(ABC):
    """Class-level declarations of a backend; the kind's base adds its own dimensions checks."""

    #: Input dtypes the kernels accept.
    supported_dtypes: ClassVar[Sequence[torch.dtype]] = (torch.float16, torch.bfloat16)
    #: Whether the backend needs a GPU compute capability (False: runs where cap is None).
    requires_device_capability: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The backend's name, e.g. ``"FLASHINFER"`` or ``"CPU_MLA"``."""

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability) -> bool:
        """Whether the kernels run on a GPU of this capability (default: any)."""
        return True

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` is in ``supported_dtypes``."""
        return dtype in cls.supported_dtypes

    @classmethod
    def is_available(cls) -> bool:
        """Whether the kernel package / native kernel is usable (asked, never assumed at
        module import)."""
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        """The reason given when ``is_available()`` is False (an install hint, ideally)."""
        return DEFAULT_UNAVAILABLE_REASON

    @classmethod
    def platform_reasons(cls, device_capability: DeviceCapability | None,
                         dtype: torch.dtype) -> list[str]:
        """The first reasons of ``validate_configuration``, in order: capability, dtype,
        availability."""
        reasons: list[str] = []
        if device_capability is None:
            if cls.requires_device_capability:
                reasons.append("device capability not available")
        elif not cls.supports_compute_capability(device_capability):
            reasons.append(f"compute capability {device_capability.major}."
                           f"{device_capability.minor} not supported")
        if not cls.supports_dtype(dtype):
            reasons.append(f"dtype {dtype} not supported")
        if not cls.is_available():
            reasons.append(cls.unavailable_reason())
        return reasons
