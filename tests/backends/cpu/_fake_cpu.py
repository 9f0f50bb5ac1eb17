"""A whole CPU faked for the tests of which unit a kernel runs on, and why.

:class:`FakeCpu` sets, for one test, everything the choice reads: the CPU's flags (both
readers: the platform's cached ``/proc/cpuinfo`` parse, ``app._cpu``, and the kernels' flag
reads in ``amx``, ``decode_kernel`` and ``torch_sdpa``; no AVX-512 emulation), whether Linux
grants the AMX tile state (never the real request: on an AMX machine it would be granted), and
which native libraries are available (nothing is built or run: the kernels are stand-ins, which
only the choice of kernel ever sees). The monkeypatch puts everything back, and the fixture clears
every cache that read the fakes, before and after, so nothing leaks into the next test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import _cpu as cpu_features
from app._cpu.emulation import EMULATE_ENV
from app.backends.cpu import amx, decode_kernel, decode_kernel_amx, kernel_paths
from app.backends.cpu.loader import NativeLibraryStatus
from app.backends.cpu.prefill_kernel import NativeKernelStatus
from app.backends.decode import cpu_mla
from app.backends.prefill import cpu_bf16_path, torch_sdpa

#: Sapphire Rapids (abridged, order kept): AMX-BF16, AVX512-BF16, AVX-512, AVX2.
SAPPHIRE_RAPIDS = ("fpu sse sse2 avx fma f16c avx2 avx512f avx512dq avx512cd avx512bw "
                   "avx512vl avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8")
#: Zen 4: AVX512-BF16, no AMX.
ZEN4 = "fpu sse sse2 avx fma f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"
#: An AVX2-only EPYC, like the machine this suite was written on.
AVX2_ONLY = "fpu sse sse2 avx fma f16c avx2"


class StandInKernel:
    """What the kernel lookups return here: only its identity is ever looked at."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StandInKernel({self.name!r})"


class _StandInLibrary:
    def __init__(self, name: str) -> None:
        self.spec = type("Spec", (), {"name": name})()
        self.path = Path(f"/nonexistent/{name}.so")


class FakeCpu:
    """Install a CPU with :meth:`flags`, the tile permission with :meth:`tiles`, and the
    native libraries with :meth:`decode_kernels` / :meth:`prefill_kernels`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.monkeypatch, self.tmp_path = monkeypatch, tmp_path
        #: The base decode kernel (``cpu_mla.load_decode_kernel``) and the AMX one.
        self.kernel = StandInKernel("avx512")
        self.amx_kernel = StandInKernel("amx")

    def flags(self, line: str) -> None:
        """This CPU's flags, for every reader (no AMX tile permission yet: :meth:`tiles`)."""
        path = self.tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: Fake CPU\nflags\t\t: {line}\n")
        flags = frozenset(line.split())
        self.monkeypatch.setattr(cpu_features, "CPUINFO_PATH", path)
        self.monkeypatch.delenv(EMULATE_ENV, raising=False)  # no AVX-512 but the fake's
        for module in (amx, decode_kernel, decode_kernel_amx, torch_sdpa):
            self.monkeypatch.setattr(module, "cpu_flags", lambda: flags)
        self.tiles(granted="amx_tile" in flags)
        clear_caches()

    def tiles(self, granted: bool) -> None:
        """Whether Linux grants this process the AMX tile state (the request is faked)."""
        refusal = None if granted else "Linux refused the AMX tile state (faked)"
        self.monkeypatch.setattr(amx, "request_tile_permission", lambda syscall=None: refusal)

    def decode_kernels(self, avx512: bool = True, amx_build: bool = True) -> None:
        """CPU_MLA's AVX-512 kernel and its AMX build available or not (never built)."""
        status = (NativeLibraryStatus(True, (), Path("/nonexistent/mla_decode_cpu.so"))
                  if avx512 else NativeLibraryStatus(False, ("no AVX-512 (faked)",)))
        for module in (kernel_paths, cpu_mla):
            self.monkeypatch.setattr(module, "decode_kernel_status",
                                     lambda: (status, "on the package's pool (faked)"))
        self.monkeypatch.setattr(cpu_mla, "load_decode_kernel",
                                 lambda: self.kernel if avx512 else None)

        def load(spec: Any) -> NativeLibraryStatus:
            if not amx_build:
                return NativeLibraryStatus(False, ("the AMX build failed (faked)",))
            return NativeLibraryStatus(True, (), Path(f"/nonexistent/{spec.name}.so"),
                                       library=_StandInLibrary(spec.name))  # type: ignore[arg-type]

        self.monkeypatch.setattr(decode_kernel_amx, "load_native_library", load)
        self.monkeypatch.setattr(decode_kernel_amx, "NativeMLADecodeKernel",
                                 lambda library: self.amx_kernel)
        self.monkeypatch.setattr(decode_kernel_amx, "_kernels", {})

    def prefill_kernels(self, native: bool = True, bf16: bool = True) -> Path:
        """TORCH_SDPA's native kernel (and its bf16-products build) available or not, their
        library files in a directory of this test (returned: the calibration is kept there).
        Never built or run."""
        directory = self.tmp_path / "libraries"
        directory.mkdir(mode=0o700, exist_ok=True)

        def status(name: str, available: bool) -> NativeKernelStatus:
            if not available:
                return NativeKernelStatus(False, (f"{name} unavailable (faked)",))
            return NativeKernelStatus(True, (), directory / f"{name}-0123abcd.so")

        self.monkeypatch.setattr(torch_sdpa, "native_kernel_status",
                                 lambda: status("mla_prefill_cpu", native))
        self.monkeypatch.setattr(torch_sdpa, "native_bf16_kernel_status",
                                 lambda: status("mla_prefill_cpu_bf16", native and bf16))
        return directory


def clear_caches() -> None:
    """Forget everything read from the (faked or real) CPU and the choices made from it."""
    cpu_features._reset_for_tests()
    decode_kernel._cpu_has_bf16_dot.cache_clear()
    cpu_bf16_path.reset_bf16_prefill_path()


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeCpu]:
    """A :class:`FakeCpu` for this test; every cache is cleared before and after."""
    clear_caches()
    yield FakeCpu(monkeypatch, tmp_path)
    monkeypatch.undo()   # the real readers back before the caches are refilled by anyone
    clear_caches()
