"""Detecting the platform of this machine, and reading a device capability a user wrote.

``APP_PLATFORM`` pins what detection answers, before platform plugins and the hardware are
consulted: ``cpu``, ``cuda`` (the visible GPU) or ``cuda:MAJOR.MINOR`` (an emulated GPU, for
selection and planning without one); unset, empty or ``auto`` detects. It lets a GPU machine run
the CPU paths (the project's test suite pins ``cpu`` for every test not marked ``gpu`` or
``detected_platform``), and a CPU machine plan for a GPU.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from app._types import DeviceCapability
from app.platforms.base import Platform
from app.platforms.cpu import CpuPlatform
from app.platforms.cuda import CudaPlatform

logger = logging.getLogger(__name__)

#: The highest compute-capability major accepted from a user (SM120 is the newest family
#: today; a few majors of room, but not 99.9 or a 23-digit typo).
MAX_CAPABILITY_MAJOR = 15
#: ``MAJOR.MINOR`` in ASCII digits only: ``int()`` alone would also take ``1_0``, ``+9``,
#: surrounding spaces and non-ASCII digits.
_CAPABILITY = re.compile(r"([0-9]{1,2})\.([0-9])", flags=re.ASCII)
CAPABILITY_ALLOWED = (f"MAJOR.MINOR with ASCII digits, major 1-{MAX_CAPABILITY_MAJOR} and minor "
                      f"0-9 (e.g. 9.0, 10.0)")


def parse_device_capability(text: object) -> DeviceCapability:
    """``"9.0"`` -> ``DeviceCapability(9, 0)``. ``ValueError`` saying what is allowed for
    anything else (``"99.9"``, ``"1_0.0"``, ``"-1.0"``, non-ASCII digits ...); ``TypeError`` for
    a non-string. The minor is one digit: ``to_int()`` is ``major * 10 + minor``."""
    if not isinstance(text, str):
        raise TypeError(f"expected a device capability string ({CAPABILITY_ALLOWED}), got "
                        f"{text!r} ({type(text).__name__})")
    match = _CAPABILITY.fullmatch(text)
    if match is None or not 1 <= int(match[1]) <= MAX_CAPABILITY_MAJOR:
        raise ValueError(f"expected {CAPABILITY_ALLOWED}, got {text!r}")
    return DeviceCapability(int(match[1]), int(match[2]))


def platform_for_device(kind: str, capability: DeviceCapability | None = None) -> Platform:
    """The built-in platform a user named: ``"cpu"``, or ``"cuda"`` (the visible GPU, or the
    GPU ``capability`` pretends to be, for selection and planning without one). The one place
    outside detection that names the concrete platform classes. ``ValueError`` for another
    ``kind``, or a capability given with ``"cpu"``."""
    if kind == "cpu":
        if capability is not None:
            raise ValueError(f"a CPU platform has no device capability, got {capability}")
        return CpuPlatform()
    if kind == "cuda":
        return CudaPlatform() if capability is None else CudaPlatform(device_capability=capability)
    raise ValueError(f"expected platform 'cpu' or 'cuda', got {kind!r}")


#: The environment variable that pins the detected platform (see the module docstring).
PLATFORM_ENV = "APP_PLATFORM"
PLATFORM_ENV_ALLOWED = "auto, cpu, cuda or cuda:MAJOR.MINOR (e.g. cuda:9.0)"


def platform_from_environment() -> Platform | None:
    """The platform ``APP_PLATFORM`` pins, or None when it is unset, empty or ``auto``.

    ``ValueError`` naming the variable and what is allowed for any other value, or for
    ``cuda`` on a machine where torch sees no GPU."""
    value = os.environ.get(PLATFORM_ENV, "").strip()
    if value in ("", "auto"):
        return None
    kind, sep, capability = value.partition(":")
    try:
        if kind == "cpu" and not sep:
            return platform_for_device("cpu")
        if kind == "cuda":
            return platform_for_device("cuda", parse_device_capability(capability)
                                       if sep else None)
    except ValueError as exc:
        raise ValueError(f"{PLATFORM_ENV}={value!r}: {exc}") from None
    raise ValueError(f"{PLATFORM_ENV}={value!r}: expected {PLATFORM_ENV_ALLOWED}")


def default_device() -> torch.device:
    """The device work runs on when none is named: the device of the platform ``APP_PLATFORM``
    pins, else the visible GPU (``cuda``), else the CPU."""
    pinned = platform_from_environment()
    if pinned is not None:
        return pinned.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def detect_platform() -> Platform:
    """The platform of this machine: the one ``APP_PLATFORM`` pins, else a platform plugin's
    (entry-point group ``app.platform_plugins``), else ``CudaPlatform`` where a CUDA GPU is
    visible, else CPU."""
    pinned = platform_from_environment()
    if pinned is not None:
        logger.debug("platform pinned by %s: %r", PLATFORM_ENV, pinned)
        return pinned
    plugin_platform = _platform_from_plugins()
    if plugin_platform is not None:
        return plugin_platform
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        platform: Platform = CudaPlatform()
    else:
        platform = CpuPlatform()
    logger.debug("detected platform %r", platform)
    return platform


def _platform_from_plugins() -> Platform | None:
    # Imported here: the plugin loader imports entry points, which may import this package.
    from app.platforms.plugins import load_platform_plugin

    return load_platform_plugin()
