"""CPU_MLA's AMX kernel (``csrc/mla_decode_amx.c``).

On a CPU without AMX the kernel's tiles are emulated in C (``csrc/amx_tiles.h``, the same
source built with ``-DAPP_AMX_EMULATE``): what these tests prove is the kernel's layouts and
index arithmetic (q.k as K . Q^T, the probabilities and V packed in key pairs, the staging of
keys that straddle blocks, the split and merged requests, the causal tail) against float64
and the conformance kit, and that it never uses a tile as the hardware would refuse. The real
build runs only where the CPU has AMX (those tests skip elsewhere), and even a parent fooled
about the CPU never runs it: its first self-test runs in a child process, which asks the CPU
itself.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.backends.cpu import decode_kernel_amx, kernel_paths
from app.backends.cpu.amx import AmxStatus
from app.backends.cpu.decode_kernel import NativeMLADecodeKernel, _reference, plan_decode
from app.backends.cpu.decode_kernel_amx import (
    SPEC_AMX_EMULATED,
    AmxDecodeStatus,
    amx_decode_status,
    load_emulated_amx_decode_kernel,
)
from app.backends.cpu.loader import cpu_flags, load_native_library, reset_native_libraries
from app.backends.decode import cpu_mla
from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.testing import assert_decode_conformance
from tests._support import native_compiler_or_skip

needs_avx512bw = pytest.mark.skipif(not {"avx512f", "avx512bw"} <= cpu_flags(),
                                    reason="the AMX source's AVX-512 parts need AVX512BW")
real_amx = pytest.mark.skipif(not amx_decode_status().available,
                              reason=f"no usable AMX here: {amx_decode_status().reason}")


@pytest.fixture(scope="module")
def emulated() -> NativeMLADecodeKernel:
    native_compiler_or_skip()
    if not {"avx512f", "avx512bw"} <= cpu_flags():
        pytest.skip("the AMX source's AVX-512 parts need AVX512BW")
    kernel = load_emulated_amx_decode_kernel()
    if kernel is None:
        pytest.fail(f"the emulated build failed: "
                    f"{load_native_library(SPEC_AMX_EMULATED).reasons}")
    return kernel


@pytest.fixture
def amx_in_cpu_mla(emulated: NativeMLADecodeKernel, monkeypatch: pytest.MonkeyPatch
                   ) -> Iterator[list[int]]:
    """CPU_MLA with the emulated AMX kernel as its bf16 kernel; yields a count of its calls."""
    calls: list[int] = []
    original = emulated.run

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(emulated, "run", counted)
    monkeypatch.setattr(cpu_mla, "load_amx_decode_kernel", lambda: emulated)
    yield calls


def _faults(kernel: NativeMLADecodeKernel) -> int:
    return int(kernel.library.function("mla_decode_amx_faults", ctypes.c_int64)())


def test_the_emulated_build_passes_its_self_test_with_no_refused_tile_operation(
        emulated: NativeMLADecodeKernel) -> None:
    assert emulated.library.function("mla_decode_amx_emulated", ctypes.c_int32)() == 1
    assert decode_kernel_amx._self_test(emulated.library) is None
    assert _faults(emulated) == 0


def test_cpu_mla_on_the_amx_kernel_conforms(amx_in_cpu_mla: list[int]) -> None:
    assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=torch.bfloat16,
                              cases=["paged", "causal_query_len_4", "max_query_len",
                                     "batch_33", "other_block_size", "nonfinite_keys",
                                     "out_buffer", "noncontiguous_q"])
    assert amx_in_cpu_mla, "CPU_MLA did not run the AMX kernel"


def test_only_bf16_steps_go_to_the_amx_kernel(amx_in_cpu_mla: list[int]) -> None:
    for dtype in (torch.float32, torch.float16):
        assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=dtype,
                                  cases=["paged"])
    assert amx_in_cpu_mla == []


def _step(heads: int, qlen: int, seq_len: int, bs: int, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-seq_len // bs)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(1, -1)
    cache = torch.randn(blocks, bs, 576, generator=gen).bfloat16()
    q = torch.randn(1, qlen, heads, 576, generator=gen).bfloat16()
    return q, cache, table


def _run(kernel: NativeMLADecodeKernel, q: torch.Tensor, cache: torch.Tensor,
         table: torch.Tensor, seq_len: int, workers: int = 1
         ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(1, q.shape[1], q.shape[2], 512, dtype=torch.float32)
    lse = torch.empty(1, q.shape[1], q.shape[2])
    kernel.run(plan_decode([seq_len], workers, 64), q, cache, table,
               torch.tensor([seq_len], dtype=torch.int32), 512, out, lse, 0.05, 1.0)
    return out, lse


@pytest.mark.parametrize("bs", [16, 7])
def test_a_hidden_non_finite_key_reaches_only_the_rows_that_see_it(
        emulated: NativeMLADecodeKernel, bs: int) -> None:
    """query_len 4: the step's last key is seen by the last row only (its other rows take it
    outside the tiles, skipping the rows it is hidden from); a NaN in its value reaches that
    row, none of the others; a NaN in a key every row sees reaches all of them."""
    seq_len = 150
    q, cache, table = _step(heads=16, qlen=4, seq_len=seq_len, bs=bs)
    last = seq_len - 1
    cache[table[0, last // bs], last % bs, 3] = float("nan")      # a value column
    out, lse = _run(emulated, q, cache, table, seq_len)
    assert torch.isnan(out[0, 3, :, 3]).all() and torch.isfinite(out[0, :3]).all()
    assert torch.isfinite(lse[0, :3]).all()
    pos = torch.arange(seq_len)
    latent = cache[table[0].long()[pos // bs], pos % bs].double()
    latent[last] = 0.0                                # rows 0-2 never see it
    ref, ref_lse = _reference(q[0].double(), latent, 512, 0.05)
    assert (out[0, :3].double() - ref[:3]).abs().max() < 2e-2
    assert (lse[0, :3].double() - ref_lse[:3]).abs().max() < 1e-3
    cache[table[0, 5 // bs], 5 % bs, 600 - 576 + 100] = float("nan")   # a key all rows see
    out, lse = _run(emulated, q, cache, table, seq_len)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    assert _faults(emulated) == 0


def test_the_amx_kernel_agrees_with_the_avx512_dot_path(emulated: NativeMLADecodeKernel) -> None:
    """Both round p to bf16 and normalise by the rounded sum: the same numbers to a few bf16
    roundings, on cache-contiguous tiles (block 64) and a split request over two workers."""
    avx = cpu_mla.load_decode_kernel()
    assert avx is not None
    q, cache, table = _step(heads=32, qlen=2, seq_len=1500, bs=64, seed=3)
    out_amx, lse_amx = _run(emulated, q, cache, table, 1500, workers=2)
    out_avx, lse_avx = _run(avx, q, cache, table, 1500, workers=2)
    assert (out_amx - out_avx).abs().max() < 1e-2
    assert (lse_amx - lse_avx).abs().max() < 1e-4
    assert math.isfinite(float(out_amx.abs().max()))


def test_the_amx_kernel_refuses_other_dtypes(emulated: NativeMLADecodeKernel) -> None:
    q, cache, table = _step(heads=2, qlen=1, seq_len=20, bs=16)
    with pytest.raises(ValueError, match="refused the call"):
        _run(emulated, q.float(), cache.float(), table, 20)


@needs_avx512bw
def test_a_parent_fooled_about_amx_still_never_runs_it(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles faked as granted in this process: the loader's instruction check reads the
    CPU itself and refuses the real AMX build before it is compiled or its child self-test runs
    (on an AMX CPU the child would run the self-test). Nothing of it runs here; nothing is
    built and no verdict is kept. (Before that check, the child refused it: this test expected
    the child's words and, skipped on AVX2 and on AMX machines, failed unseen on AVX-512 ones
    without AMX until it ran under APP_CPU_EMULATE_AVX512.)"""
    native_compiler_or_skip()
    if {"amx_tile", "amx_bf16"} <= cpu_flags():
        pytest.skip("this CPU has AMX: the child would really test the kernel")
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("APP_CPU_DECODE_OPENMP", "0")    # one build, one child
    monkeypatch.setattr(decode_kernel_amx, "amx_status",
                        lambda: AmxStatus(True, "faked for the test"))
    for spec in (decode_kernel_amx.SPEC_AMX, decode_kernel_amx.SPEC_AMX_OPENMP):
        reset_native_libraries(spec.name)
    try:
        status = amx_decode_status()
    finally:
        for spec in (decode_kernel_amx.SPEC_AMX, decode_kernel_amx.SPEC_AMX_OPENMP):
            reset_native_libraries(spec.name)
    assert not status.available
    assert "built for amx_bf16, amx_tile" in status.reason
    assert "which this CPU lacks (its /proc/cpuinfo flags do not list them)" in status.reason
    assert list(tmp_path.rglob("*.verdict.json")) == [] and list(tmp_path.rglob("*.so")) == []


def test_the_kernel_path_says_which_unit_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    library = load_native_library(cpu_mla.SPEC).library
    if library is None:
        pytest.skip("the native decode kernel cannot run here")
    fake = {"tiles": AmxDecodeStatus(library, "self-test passed (lib.so)", "on the pool", True),
            "refused": AmxDecodeStatus(None, "Linux refused the AMX tile state: ... EPERM",
                                       amx_cpu=True),
            "none": AmxDecodeStatus(None, "this CPU has no AMX-BF16 tiles")}
    monkeypatch.setattr(kernel_paths, "has_bf16_dot", lambda: True)
    monkeypatch.setattr(kernel_paths, "amx_decode_status", lambda: fake["tiles"])
    assert CpuMLADecodeBackend.kernel_path(torch.bfloat16).startswith(
        "AMX-BF16 tiles (self-test passed (lib.so)")
    assert CpuMLADecodeBackend.kernel_path(torch.float32) == "float32 FMAs (AVX-512F)"
    monkeypatch.setattr(kernel_paths, "amx_decode_status", lambda: fake["refused"])
    assert CpuMLADecodeBackend.kernel_path(torch.bfloat16) == (
        "AVX512-BF16 dot products (vdpbf16ps, float32 sums): AMX present but not used: "
        "Linux refused the AMX tile state: ... EPERM")
    monkeypatch.setattr(kernel_paths, "amx_decode_status", lambda: fake["none"])
    assert "; no AMX (this CPU has no AMX-BF16 tiles)" in CpuMLADecodeBackend.kernel_path(
        torch.bfloat16)


@real_amx
def test_the_real_amx_kernel_conforms() -> None:
    """Only on a CPU with AMX that granted the tile state (the kernel passed its self-tests,
    first in a child process)."""
    assert CpuMLADecodeBackend.kernel_path(torch.bfloat16).startswith("AMX-BF16 tiles")
    kernel = decode_kernel_amx.load_amx_decode_kernel()
    assert kernel is not None
    assert kernel.library.function("mla_decode_amx_emulated", ctypes.c_int32)() == 0
    assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=torch.bfloat16)
    q, cache, table = _step(heads=128, qlen=4, seq_len=2000, bs=16)
    emulated = load_emulated_amx_decode_kernel()
    if emulated is not None:   # the instructions do what the emulation does
        out_real, lse_real = _run(kernel, q, cache, table, 2000, workers=2)
        out_emu, lse_emu = _run(emulated, q, cache, table, 2000, workers=2)
        assert (out_real - out_emu).abs().max() < 2e-3
        assert (lse_real - lse_emu).abs().max() < 1e-4
