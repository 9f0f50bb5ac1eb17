"""What every conformance kit shares and imports first: the failure a case raises and the
device's capability. (``app.testing.conformance`` re-exports both: their documented home.)"""

from __future__ import annotations

import torch

from app._types import DeviceCapability

__all__ = ["CaseFailure", "device_capability_of"]


class CaseFailure(Exception):
    """A kit's case found the backend wrong (the message says how); ``run_cases`` reports it."""


def device_capability_of(device: torch.device) -> DeviceCapability | None:
    """The compute capability of a CUDA ``device`` (None for any other device)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return DeviceCapability(major, minor)
