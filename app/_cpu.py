"""Facts about this machine (the host) that the platform, the CPU kernels and the engine read:
its CPU's vector features, read from the CPU itself (not torch's capability string); the
memory a new allocation can get now (read, never assumed); and how host values reach a device
without the host waiting for it (``copy_to_device``). Public as
:mod:`app.platforms.cpu_features`; it lives here, below every other module, so kernels and
the layer can read it without importing the platforms package.

On Linux the flags come from ``/proc/cpuinfo`` (the kernel's ``cpuid`` decoding, already masked
by what the OS enables: ``amx_bf16`` only appears when the kernel manages the AMX tile state).
Elsewhere :func:`read_cpu_features` falls back to torch's CPU capability string, which knows
AVX-512 and AMX but not AVX512-BF16 or AVX512-FP16 (those read False there; ``source`` says
which way the answer was found). Why not torch's string everywhere: it says ``AVX512`` on an
AMD EPYC with AVX512-BF16, so bf16 work was sent down float32 paths that ran ~4x slower.

The features that decide kernels here:

- ``avx512f``: the native CPU kernels' float32 path (``vfmadd231ps`` on 16 lanes);
- ``avx512_bf16``: ``vdpbf16ps``, a bf16 pair dot product accumulated in float32 (the bf16
  prefill kernel, the bf16 peak probe, bf16 projections);
- ``amx_bf16``: AMX tiles with bf16 dot products (bf16 matmuls in oneDNN / torch);
- ``avx512_fp16``: native fp16 arithmetic (fast fp16 matmuls).
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

__all__ = [
    "CPUINFO_PATH",
    "FEATURE_NAMES",
    "CpuFeatures",
    "available_host_bytes",
    "copy_to_device",
    "cpu_flags",
    "cpu_has_native_bf16",
    "detect_cpu_features",
    "parse_cpuinfo",
    "physical_memory_bytes",
    "read_cpu_features",
    "required_cpu_flags",
]

#: Where Linux publishes the CPU's flags.
CPUINFO_PATH = Path("/proc/cpuinfo")
#: The features reported, by their ``/proc/cpuinfo`` flag names.
FEATURE_NAMES = ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")


@attrs.frozen
class CpuFeatures:
    """The vector features of this CPU that the kernels care about, and where they were read.

    ``model_name`` is the CPU's model string (``/proc/cpuinfo``'s ``model name``, else the
    platform's processor name); ``source`` is ``"/proc/cpuinfo"`` (or the file read),
    ``"torch capability AVX512"`` (fallback) or ``"none"`` (not an x86-64 CPU).
    """

    avx512f: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    avx512_fp16: bool = False
    model_name: str = ""
    source: str = "none"

    @property
    def fast_bfloat16(self) -> bool:
        """True where bf16 products run natively: AVX512-BF16 (``vdpbf16ps``) or AMX-BF16."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def fast_float16(self) -> bool:
        """True where fp16 arithmetic runs natively (AVX512-FP16)."""
        return self.avx512_fp16

    def present(self) -> list[str]:
        """The names of :data:`FEATURE_NAMES` this CPU has, in that order."""
        return [name for name in FEATURE_NAMES if getattr(self, name)]

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly: every feature as a bool, the model name and the source."""
        return {**{name: getattr(self, name) for name in FEATURE_NAMES},
                "model_name": self.model_name, "source": self.source}

    def describe(self) -> str:
        """One line: ``avx512f=yes avx512_bf16=no ... (from /proc/cpuinfo)``."""
        flags = " ".join(f"{name}={'yes' if getattr(self, name) else 'no'}"
                         for name in FEATURE_NAMES)
        return f"{flags} (from {self.source})"


def parse_cpuinfo(text: str, source: str = str(CPUINFO_PATH)) -> CpuFeatures:
    """The features in the text of a ``/proc/cpuinfo``: the first processor's ``flags`` line
    (x86) and ``model name``. ``ValueError`` when the text has no ``flags`` line."""
    flags: set[str] | None = None
    model = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "flags" and flags is None:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    if flags is None:
        raise ValueError(f"{source}: expected a 'flags' line (x86 /proc/cpuinfo), found none")
    return CpuFeatures(avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                       amx_bf16="amx_bf16" in flags, avx512_fp16="avx512_fp16" in flags,
                       model_name=model, source=source)


def _from_torch_capability() -> CpuFeatures:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuFeatures(model_name=platform.processor() or platform.machine())
    capability = torch.backends.cpu.get_cpu_capability().upper()
    # torch's string ranks DEFAULT < AVX2 < AVX512 < AMX (an AMX CPU has AVX512-BF16 too).
    amx = capability.startswith("AMX")
    return CpuFeatures(avx512f=amx or capability.startswith("AVX512"), avx512_bf16=amx,
                       amx_bf16=amx, model_name=platform.processor() or platform.machine(),
                       source=f"torch capability {capability}")


def read_cpu_features(cpuinfo: Path | str | None = None) -> CpuFeatures:
    """Read the features now (no caching): from ``cpuinfo`` (default ``/proc/cpuinfo``) on
    Linux x86, falling back to torch's capability string where the file is absent, unreadable
    or has no ``flags`` line (another OS, another architecture)."""
    path = Path(cpuinfo) if cpuinfo is not None else CPUINFO_PATH
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return _from_torch_capability()
    try:
        return parse_cpuinfo(text, str(path))
    except ValueError:
        return _from_torch_capability()


_lock = threading.Lock()


@functools.cache
def _cached() -> CpuFeatures:
    return read_cpu_features()


def detect_cpu_features() -> CpuFeatures:
    """This machine's features, read once per process (thread-safe)."""
    with _lock:
        return _cached()


def _reset_for_tests() -> None:
    """Forget the cached features, so the next :func:`detect_cpu_features` reads them again."""
    with _lock:
        _cached.cache_clear()


def cpu_has_native_bf16() -> bool:
    """Whether bf16 products run natively (AVX512-BF16 or AMX-BF16, read from the CPU);
    plain AVX2 / AVX512 convert through float32."""
    return detect_cpu_features().fast_bfloat16


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


# -- the flags a native library needs ----------------------------------------------------

def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none), read every
    call: what the native loader checks a library's instruction sets against."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


#: ``-m`` flags whose ``/proc/cpuinfo`` name is not theirs with ``-`` made ``_``.
_ISA_FLAG_NAMES = {"avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
                   "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8",
                   "sse4.1": "sse4_1", "sse4.2": "sse4_2"}
#: ``-m`` flags that are not instruction sets.
_NOT_ISA = ("arch=", "tune=", "no-", "cpu=", "fpmath=", "abi=", "cmodel=", "prefer-")


def required_cpu_flags(flags: Sequence[str]) -> frozenset[str]:
    """The ``/proc/cpuinfo`` flags a library built with the compiler ``flags`` needs: one per
    ISA flag (``-mavx512f`` -> ``avx512f``, ``-mavx512bf16`` -> ``avx512_bf16``); flags that
    name no instruction set (``-O3``, ``-D...``, ``-march=...``) need nothing."""
    needed = set()
    for flag in flags:
        if not flag.startswith("-m") or flag[2:].startswith(_NOT_ISA):
            continue
        name = flag[2:]
        needed.add(_ISA_FLAG_NAMES.get(name, name.replace("-", "_")))
    return frozenset(needed)
