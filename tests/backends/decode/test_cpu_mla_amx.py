"""CPU_MLA on a CPU that reports AMX (faked /proc/cpuinfo flags). The flags alone never put a
bf16 step on the AMX kernel: Linux must grant the tile state and the kernel pass its
self-tests. Here Linux's answer is faked too (a refusal, as on any CPU without AMX or under a
seccomp profile; on a real AMX CPU the real request is granted, and reading it sent bf16 to
the tiles, issue 43), so selection, the bf16 dot-product path and the benchmark behave as on
any AVX512-BF16 CPU and say why AMX is not used, on every machine alike; AMX without
AVX512-BF16 must never reach ``vdpbf16ps``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from app import _cpu as cpu_features_module
from app._cpu.emulation import EMULATE_ENV
from app.backends import explain_mla_decode_selection, get_mla_decode_backend
from app.backends.cpu import amx, decode_kernel
from app.backends.cpu.loader import cpu_flags
from app.backends.decode import cpu_mla as cpu_mla_decode
from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.bench import _peaks as peaks
from app.bench import decode as bench_decode
from app.bench._peaks import BF16_DOT, BF16_MATMUL, FP32_FMA, PeakMeter, peak_kinds
from app.config import EngineConfig, ModelConfig
from app.containers import create_container
from app.platforms import CpuPlatform
from app.testing import assert_decode_conformance

# A Sapphire Rapids flags line (abridged, order kept): AMX-BF16 and AVX512-BF16 together.
SAPPHIRE_RAPIDS = ("fpu sse sse2 avx fma f16c avx2 avx512f avx512dq avx512cd avx512bw "
                   "avx512vl avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8")
# AMX tiles but no AVX512-BF16 (no such CPU is sold, but a hypervisor can mask flags so).
AMX_ONLY = "fpu sse sse2 avx fma f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl " \
           "amx_bf16 amx_tile amx_int8"

# What Linux answers a process that may not have the tile state (amx._ask's wording).
REFUSED = ("Linux refused the AMX tile state: arch_prctl(ARCH_REQ_XCOMP_PERM, "
           "XFEATURE_XTILEDATA) failed with EPERM (refused by a security policy: faked by "
           "the test)")

needs_kernel = pytest.mark.skipif(not CpuMLADecodeBackend.is_available(),
                                  reason="the native decode kernel cannot run here")
# The kernel really executes vdpbf16ps when the (faked) flags say AVX512-BF16: only here.
needs_real_bf16 = pytest.mark.skipif(
    not ({"avx512_bf16", "avx512bw"} <= cpu_flags()),
    reason="this CPU has no AVX512-BF16: the bf16 dot path cannot run here")


@pytest.fixture
def fake_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[Callable[[str], None]]:
    """Sets both flag readers (the platform's cached one and the kernels' /proc/cpuinfo
    read) to a flags line of our own, and Linux's answer to the tile-state request to a
    refusal (every AMX path, the decode kernel and the peak probe, asks ``amx.amx_status``);
    restores them after, and drops any peak probe measured before or under the fake."""

    def install(flags: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: Fake Xeon\nflags\t\t: {flags}\n")
        monkeypatch.setattr(cpu_features_module, "CPUINFO_PATH", path)
        monkeypatch.setattr(decode_kernel, "cpu_flags", lambda: frozenset(flags.split()))
        monkeypatch.setattr(amx, "cpu_flags", lambda: frozenset(flags.split()))
        monkeypatch.setattr(amx, "request_tile_permission", lambda syscall=None: REFUSED)
        monkeypatch.delenv(amx.AMX_ENV, raising=False)  # the refusal decides, not the switch
        monkeypatch.delenv(EMULATE_ENV, raising=False)  # the faked CPU's own AVX-512 only
        cpu_features_module._reset_for_tests()
        decode_kernel._cpu_has_bf16_dot.cache_clear()
        peaks._probe.clear()  # one built earlier may hold the real AMX probe

    yield install
    cpu_features_module._reset_for_tests()
    decode_kernel._cpu_has_bf16_dot.cache_clear()
    # nothing loaded or measured under the fake flags outlives the test
    peaks._probe.clear()


def test_an_amx_cpu_selects_cpu_mla_on_its_bf16_dot_products(
        fake_cpu: Callable[[str], None]) -> None:
    fake_cpu(SAPPHIRE_RAPIDS)
    assert cpu_features_module.detect_cpu_features().amx_bf16
    assert CpuPlatform().has_fast_bfloat16()
    assert cpu_mla_decode.has_bf16_dot()          # AVX512-BF16 is there: the dot path
    container = create_container(EngineConfig(model=ModelConfig(dtype=torch.bfloat16)),
                                 CpuPlatform())
    if CpuMLADecodeBackend.is_available():
        assert get_mla_decode_backend(container=container) is CpuMLADecodeBackend
        assert get_mla_decode_backend(query_len=4, container=container) is CpuMLADecodeBackend
    explanation = explain_mla_decode_selection(container=container)
    assert explanation["priorities"][:2] == ["CPU_MLA", "TORCH_SDPA"]
    # The kernel multiplies on the bf16 dot products (not AMX tiles) ...
    assert bench_decode._bound_peak(CpuMLADecodeBackend, torch.bfloat16) == BF16_DOT
    assert bench_decode._bound_peak(CpuMLADecodeBackend, torch.float32) == FP32_FMA
    # ... but a bf16 row is charged at the fastest unit the CPU offers: with the tiles not
    # probed (refused here), torch's bf16 matmul (oneDNN's AMX) stands in for them.
    meter = PeakMeter(torch.device("cpu"), probe=None)
    meter.runs = {BF16_DOT: [400.0], BF16_MATMUL: [300.0], FP32_FMA: [200.0]}
    assert bench_decode._bound_peak(CpuMLADecodeBackend, torch.bfloat16, meter) == BF16_MATMUL
    assert bench_decode._bound_peak(CpuMLADecodeBackend, torch.float32, meter) == FP32_FMA
    assert amx.amx_status().reason == REFUSED
    assert peak_kinds()["amx_bf16"] == REFUSED   # the probe is not built, and says why
    if CpuMLADecodeBackend.is_available():
        path = explanation["kernel_path"]
        assert path == CpuMLADecodeBackend.kernel_path(torch.bfloat16)
        assert path.startswith("AVX512-BF16 dot products (vdpbf16ps, float32 sums): AMX "
                               "present but not used: Linux refused the AMX tile state")


@needs_kernel
@needs_real_bf16
def test_the_bf16_path_conforms_on_an_amx_cpu(fake_cpu: Callable[[str], None]) -> None:
    fake_cpu(SAPPHIRE_RAPIDS)
    assert cpu_mla_decode.has_bf16_dot()
    assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=torch.bfloat16,
                              cases=["paged", "causal_query_len_4", "batch_33",
                                     "nonfinite_keys"])


@needs_kernel
def test_amx_without_avx512_bf16_keeps_float32_math(fake_cpu: Callable[[str], None]) -> None:
    """AMX alone must not send bf16 down vdpbf16ps: float32 math, still correct."""
    fake_cpu(AMX_ONLY)
    assert cpu_features_module.detect_cpu_features().amx_bf16
    assert not cpu_mla_decode.has_bf16_dot()
    kernel = cpu_mla_decode.load_decode_kernel()
    assert kernel is not None
    q = torch.randn(1, 1, 2, 576).bfloat16()
    cache = torch.randn(2, 16, 576).bfloat16()
    with pytest.raises(ValueError, match="bf16_dot needs"):
        kernel.run(cpu_mla_decode.plan_decode([5], 1), q, cache,
                   torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                   512, torch.empty(1, 1, 2, 512, dtype=torch.bfloat16), None, 0.1, 1.0,
                   bf16_dot=True)
    assert bench_decode._bound_peak(CpuMLADecodeBackend, torch.bfloat16) == FP32_FMA
    assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=torch.bfloat16,
                              cases=["paged", "causal_query_len_4", "nonfinite_keys"])
