"""A pytest plugin shipped with the package (entry point ``pytest11``): container fixtures.

- ``app_container``: a fresh container, active for the test; nothing leaks into other tests.
- ``override_prefill_backend``: ``override_prefill_backend(member, cls_or_path)`` replaces a
  prefill backend in the test's container until the test ends.
- ``fake_platform``: ``fake_platform(DeviceCapability(10, 0))`` (or ``(10, 0)``, or None for
  a CPU) makes the test's container pretend to run on that device.

Any test in a project that installs this package can use them without importing anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dependency_injector import providers

from app._types import DeviceCapability
from app.containers import Application, create_container, use_container
from app.platforms import Platform, platform_for_device

__all__ = ["app_container", "fake_platform", "override_prefill_backend"]


@pytest.fixture
def app_container() -> Iterator[Application]:
    """A fresh container, active for the duration of the test."""
    container = create_container()
    with use_container(container):
        yield container


@pytest.fixture
def override_prefill_backend(app_container: Application) -> Iterator[Callable[[Any, Any], None]]:
    """A function ``(member, cls_or_path)`` that overrides a backend for the rest of the test."""
    from app.seed_api import override_mla_prefill_backend

    with contextlib.ExitStack() as stack:
        def override(member: Any, cls_or_path: Any) -> None:
            stack.enter_context(override_mla_prefill_backend(member, cls_or_path))

        yield override


@pytest.fixture
def fake_platform(app_container: Application
                  ) -> Iterator[Callable[[DeviceCapability | tuple[int, int] | None], Platform]]:
    """A function ``(capability)`` that makes the test's container run on a pretend device:
    a ``CudaPlatform`` of that capability, or a ``CpuPlatform`` for None."""
    with contextlib.ExitStack() as stack:
        def fake(capability: DeviceCapability | tuple[int, int] | None) -> Platform:
            if capability is None:
                platform = platform_for_device("cpu")
            else:
                if isinstance(capability, tuple):
                    capability = DeviceCapability(*capability)
                platform = platform_for_device("cuda", capability)
            stack.enter_context(app_container.platform.override(providers.Object(platform)))
            return platform

        yield fake
