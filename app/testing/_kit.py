"""What every conformance kit shares and imports first: the failure a case raises, the
device's capability, and the error a case measures.
(``app.testing.conformance`` re-exports the first two: their documented home.)"""

from __future__ import annotations

import torch

from app._types import DeviceCapability

__all__ = ["CaseFailure", "device_capability_of", "max_abs_error"]


class CaseFailure(Exception):
    """A kit's case found the backend wrong (the message says how); ``run_cases`` reports it."""


def device_capability_of(device: torch.device) -> DeviceCapability | None:
    """The compute capability of a CUDA ``device`` (None for any other device)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return DeviceCapability(major, minor)


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` (0 for empty tensors)."""
    return float((a - b).abs().max().item()) if a.numel() else 0.0
