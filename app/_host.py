"""What the host has: the memory a new allocation can get now (read, never assumed); and how
host values reach a device without the host waiting for it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["available_host_bytes", "copy_to_device", "physical_memory_bytes"]


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host`` on ``device``, without a host-device synchronisation: ``host``
    itself on the CPU; elsewhere an asynchronous copy from pinned memory (a plain ``.to(device)``
    of pageable memory waits for every kernel queued before it). The copy is queued on the
    current stream, before any kernel that reads it; the pinned staging buffer is not reused
    until the copy is done (torch's caching host allocator records that)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def physical_memory_bytes() -> int | None:
    """The host's physical memory; None where ``sysconf`` cannot tell."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_host_bytes() -> int | None:
    """Host memory a new allocation can get now: ``MemAvailable`` of ``/proc/meminfo`` (free
    plus reclaimable), else the physical memory; None when neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory_bytes()
