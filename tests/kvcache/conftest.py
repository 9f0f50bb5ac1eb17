"""Every KV-cache test runs in a fresh container (a CPU platform), so registrations never leak."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.containers import Application, create_container, use_container
from app.platforms import CpuPlatform


@pytest.fixture(autouse=True)
def kv_container() -> Iterator[Application]:
    """A fresh container on a CPU platform, active for the test."""
    container = create_container(platform=CpuPlatform())
    with use_container(container):
        yield container
