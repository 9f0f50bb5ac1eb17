"""A pytest plugin shipped with the package (entry point ``pytest11``): container fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.containers import Application, create_container, use_container


@pytest.fixture
def app_container() -> Iterator[Application]:
    """A fresh container, active for the duration of the test."""
    container = create_container()
    with use_container(container):
        yield container
