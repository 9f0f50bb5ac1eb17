"""Kernel workspaces: scratch buffers a kernel needs, one per (name, device), shared by whoever
is handed the same ``KernelWorkspaces``.

The container holds one (its ``kernel_workspaces`` provider) and passes it to every backend it
builds, prefill and decode alike, so the backends of a container share one buffer per kernel
and device and two containers share nothing. A backend built without one makes its own.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import torch

from app._validation import check_int_at_least

__all__ = ["KernelWorkspaces", "WorkspaceSource"]


@runtime_checkable
class WorkspaceSource(Protocol):
    """Where a backend gets its kernel workspaces: ``get(name, nbytes, device, zeroed=)``
    returns a 1-D ``uint8`` tensor of at least ``nbytes`` bytes for kernel ``name`` on
    ``device`` (``KernelWorkspaces`` has this shape)."""

    def get(self, name: str, nbytes: int, device: torch.device, *,
            zeroed: bool = False) -> torch.Tensor:
        """The workspace ``name`` on ``device``, at least ``nbytes`` bytes."""
        ...


class KernelWorkspaces:
    """Kernel workspaces, one ``uint8`` buffer per (name, device), made on first use and
    *replaced* by a larger one when a call needs more (the old buffer is dropped, not kept
    beside it). ``zeroed``: made with ``torch.zeros`` (some kernels keep counters in their
    workspace and need them zero on first use). Thread-safe."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, name: str, nbytes: int, device: torch.device | str, *,
            zeroed: bool = False) -> torch.Tensor:
        """The ``uint8`` workspace ``name`` on ``device``, at least ``nbytes`` (and 1) bytes."""
        check_int_at_least("KernelWorkspaces.get: nbytes", nbytes, 0)
        key = (name, torch.device(device))
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < max(nbytes, 1):
                make = torch.zeros if zeroed else torch.empty
                buf = make(max(nbytes, 1), dtype=torch.uint8, device=key[1])
                self._buffers[key] = buf
            return buf

    def nbytes(self, name: str, device: torch.device | str) -> int:
        """The size of buffer ``name`` on ``device`` (0 before the first ``get``)."""
        with self._lock:
            buf = self._buffers.get((name, torch.device(device)))
            return 0 if buf is None else int(buf.numel())

    def __len__(self) -> int:
        return len(self._buffers)

    def __repr__(self) -> str:
        return f"KernelWorkspaces({sorted((n, str(d)) for n, d in self._buffers)})"
