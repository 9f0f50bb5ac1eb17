"""What the host has: the memory a new allocation can get now (read, never assumed)."""

from __future__ import annotations

import os

__all__ = ["available_host_bytes", "physical_memory_bytes"]


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
