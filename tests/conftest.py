"""Every test runs on the CPU platform unless it is marked otherwise (issue 35).

On a machine with a GPU, platform detection picks the CUDA platform, and the tests written on
CPU machines then selected FLASHINFER where they expect TORCH_SDPA, ran the engine on ``cuda:0``
and said "GiB of cuda:0 memory" where they expect the CPU's (the first H100 run). So this
fixture sets ``APP_PLATFORM=cpu`` (read by ``app.platforms.detect_platform`` and by the
benchmarks' default device) for every test, subprocesses included, and a new test is pinned
without saying anything. A test opts out with a marker, which makes the exception easy to spot:

- ``gpu``: needs a real GPU (skipped without CUDA) and runs on the machine's own detection;
- ``detected_platform``: is about detection itself (plugins, the machine's platform).

Both see ``APP_PLATFORM`` removed, whatever the environment of the run says.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app import _container_state
from app.platforms import PLATFORM_ENV

#: The markers that run a test on the detected platform instead of the CPU.
UNPINNED_MARKERS = ("gpu", "detected_platform")

_last_pin: list[str | None] = []


@pytest.fixture(autouse=True)
def _cpu_platform_unless_marked(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``APP_PLATFORM=cpu`` for the test, or no ``APP_PLATFORM`` for ``UNPINNED_MARKERS``."""
    unpinned = any(request.node.get_closest_marker(m) for m in UNPINNED_MARKERS)
    pin = None if unpinned else "cpu"
    if pin is None:
        monkeypatch.delenv(PLATFORM_ENV, raising=False)
    else:
        monkeypatch.setenv(PLATFORM_ENV, pin)
    if _last_pin and _last_pin[0] != pin:
        # The process-default container keeps the platform it detected first: detect again
        # under this test's pin (its registrations stay).
        default = _container_state._default
        if default is not None:
            default.platform.reset()
    _last_pin[:] = [pin]
    yield


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """torch's thread count as the test found it: a command run in-process sizes torch's
    threads from the machine (``app._cpu.apply_thread_count``), and the next test must
    not inherit that."""
    import torch

    old = torch.get_num_threads()
    yield
    if torch.get_num_threads() != old:
        torch.set_num_threads(old)
