"""The AMX-BF16 peak probe (``csrc/cpu_peaks_amx.c``): ``bench prefill`` and ``bench decode``
charge bf16 work at it where the CPU has AMX (:mod:`app.bench._peaks`).

Guarded as the AMX decode kernel is (:mod:`app.backends.cpu.decode_kernel_amx`): built and
loaded only where the CPU has AMX tiles, ``APP_CPU_AMX`` allows them and Linux granted the tile
state, and used only after its self-test (the loop's result, exact in float32) passed in a
child process first. ``SPEC_AMX_PEAK_EMULATED`` is the same source with the tiles emulated in
C, for the tests on any CPU (its rate means nothing).
"""

from __future__ import annotations

import ctypes
import threading

from app.backends.cpu.amx import AMX_ENV, amx_status
from app.backends.cpu.loader import NativeLibrary, NativeLibrarySpec, load_native_library

__all__ = ["SPEC_AMX_PEAK", "SPEC_AMX_PEAK_EMULATED", "AmxPeakProbe", "amx_peak_probe_status",
           "load_amx_peak_probe"]

#: ``APP_NATIVE_LIBRARY(...)`` in ``csrc/cpu_peaks_amx.c``.
ABI_VERSION = 1
#: bf16 (1.0, 1.0) in both halves of a 32-bit element.
_ONES = 0x3F803F80


class AmxPeakProbe:
    """One probe call: :meth:`call` runs ``iters`` iterations of 6 TDPBF16PS on this thread
    (configuring and releasing the tiles itself); ``flops_per_iter`` per iteration."""

    def __init__(self, library: NativeLibrary) -> None:
        self.library = library
        self._call = library.function("cpu_peak_amx_bf16", ctypes.c_float, ctypes.c_int64,
                                      ctypes.c_uint32)
        self.flops_per_iter = int(library.function("cpu_peak_amx_bf16_flops_per_iter",
                                                   ctypes.c_int64)())
        self.emulated = bool(library.function("cpu_peak_amx_emulated", ctypes.c_int32)())

    def call(self, iters: int) -> float:
        """``iters`` iterations; returns the first accumulator's first element (32 * iters)."""
        return float(self._call(iters, _ONES))


def _self_test(library: NativeLibrary) -> str | None:
    probe = AmxPeakProbe(library)
    got = [probe.call(n) for n in (1, 3, 1000)]
    if got != [32.0, 96.0, 32000.0]:
        return f"the tile loop summed {got}, expected [32.0, 96.0, 32000.0]"
    faults = int(library.function("cpu_peak_amx_faults", ctypes.c_int64)())
    return f"{faults} tile operations the hardware would refuse" if faults else None


def _requirements() -> list[str]:
    status = amx_status()
    return [] if status.available else [status.reason]


_MODULE = "app.backends.cpu.amx_probe"
#: The probe on the AMX tiles.
SPEC_AMX_PEAK = NativeLibrarySpec(
    name="cpu_peaks_amx", sources=("cpu_peaks_amx.c",), abi_version=ABI_VERSION,
    flags=("-O2", "-mamx-tile", "-mamx-bf16"), link_flags=(), self_test=_self_test,
    requirements=_requirements, switches=(AMX_ENV,), child_test=f"{_MODULE}:SPEC_AMX_PEAK")
#: The same loop with emulated tiles (tests).
SPEC_AMX_PEAK_EMULATED = NativeLibrarySpec(
    name="cpu_peaks_amx_emulated", sources=SPEC_AMX_PEAK.sources, abi_version=ABI_VERSION,
    flags=("-O2", "-DAPP_AMX_EMULATE"), link_flags=(), self_test=_self_test,
    child_test=f"{_MODULE}:SPEC_AMX_PEAK_EMULATED")

_lock = threading.Lock()
_probes: dict[str, tuple[NativeLibrary, AmxPeakProbe]] = {}


def amx_peak_probe_status(emulated: bool = False) -> tuple[bool, str]:
    """(whether the AMX probe runs here, why not or what was loaded); builds it on first use
    on an AMX CPU only."""
    if not emulated:
        status = amx_status()
        if not status.available:
            return False, status.reason
    loaded = load_native_library(SPEC_AMX_PEAK_EMULATED if emulated else SPEC_AMX_PEAK)
    if not loaded.available:
        return False, "the AMX probe is unusable: " + "; ".join(loaded.reasons)
    return True, f"self-test passed ({loaded.path})"


def load_amx_peak_probe(emulated: bool = False) -> AmxPeakProbe | None:
    """The AMX probe (``emulated``: the C emulation, for tests), or None where it cannot run
    (:func:`amx_peak_probe_status` says why)."""
    if not emulated and not amx_status().available:
        return None
    library = load_native_library(SPEC_AMX_PEAK_EMULATED if emulated else SPEC_AMX_PEAK).library
    if library is None:
        return None
    with _lock:
        found = _probes.get(library.spec.name)
        if found is None or found[0] is not library:
            found = _probes[library.spec.name] = (library, AmxPeakProbe(library))
        return found[1]
