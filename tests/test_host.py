"""``app._cpu``: the memory there is, read from the host."""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from app import _cpu


def test_available_memory_is_read_and_bounded_by_the_physical_memory() -> None:
    have, physical = _cpu.available_host_bytes(), _cpu.physical_memory_bytes()
    assert have is None or have > 0
    if have is not None and physical is not None:
        assert have <= physical


def test_without_meminfo_the_physical_memory_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.open

    def no_meminfo(file: Any, *args: Any, **kwargs: Any) -> Any:
        if file == "/proc/meminfo":
            raise FileNotFoundError(file)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    assert _cpu.available_host_bytes() == _cpu.physical_memory_bytes()
