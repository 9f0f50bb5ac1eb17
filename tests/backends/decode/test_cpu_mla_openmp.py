"""CPU_MLA's shares on torch's OpenMP team: bound to torch's own ``libgomp.so.1``, the same
results as on the package's pool, any share count against any team size, the fallbacks (the
switch, another runtime) and what they say, and a forked child after the parent decoded."""

from __future__ import annotations

import os
import pickle
import select
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.backends.cpu import decode_kernel, openmp
from app.backends.cpu.loader import load_native_library, reset_native_libraries
from app.backends.decode import cpu_mla
from app.backends.decode.cpu_mla import CpuMLADecodeBackend, plan_decode
from app.commands.platform import collect
from app.testing import reference_decode

needs_openmp = pytest.mark.skipif(
    not CpuMLADecodeBackend.is_available()
    or not load_native_library(cpu_mla.SPEC_OPENMP).available,
    reason="the OpenMP build of the decode kernel cannot run here")
NAMES = (cpu_mla.SPEC.name, cpu_mla.SPEC_OPENMP.name)


@pytest.fixture
def fresh_libraries() -> Iterator[None]:
    """Forget both decode builds before and after (the next load probes again)."""
    for name in NAMES:
        reset_native_libraries(name)
    yield
    for name in NAMES:
        reset_native_libraries(name)


def _step(seed: int, lens: list[int], heads: int = 16, qlen: int = 2,
          dtype: torch.dtype = torch.bfloat16
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [B, qlen, heads, 576], cache [N, 16, 576], table int32 [B, W], seq_lens)``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // 16) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start:start + n]
        start += n
    cache = torch.randn(sum(blocks), 16, 576, generator=gen).to(dtype)
    q = torch.randn(len(lens), qlen, heads, 576, generator=gen).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def _decode(step: tuple[torch.Tensor, ...], workers: int, use_openmp: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = cpu_mla.load_decode_kernel()
    assert kernel is not None
    q, cache, table, seq_lens = step
    plan = plan_decode(seq_lens.tolist(), workers, min_keys_per_part=64)
    out = torch.empty(*q.shape[:3], 512, dtype=q.dtype)
    lse = torch.empty(*q.shape[:3])
    kernel.run(plan, q, cache, table, seq_lens, 512, out, lse, 0.06, 1.0, openmp=use_openmp)
    return out, lse


@needs_openmp
def test_the_openmp_build_runs_on_torchs_libgomp() -> None:
    status, how = cpu_mla.decode_kernel_status()
    assert status.path is not None and status.path.name.startswith("mla_decode_cpu_openmp-")
    assert "OpenMP threads" in how
    kernel = cpu_mla.load_decode_kernel()
    assert kernel is not None and kernel.openmp
    runtime, _ = openmp.torch_libgomp()
    assert runtime is not None
    ours = kernel.library.function("mla_decode_cpu_openmp_runtime", decode_kernel._ptr)()
    assert ours == openmp.runtime_function_address(runtime, "omp_get_max_threads")
    gomps = {p for p in openmp._loaded_openmp_runtimes() if p.name.startswith("libgomp")}
    assert gomps == {runtime}                  # no second runtime came in with our library
    assert "OpenMP threads" in collect()["cpu_decode_kernel"]


@needs_openmp
@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_openmp_shares_match_the_pool_and_the_reference(workers: int) -> None:
    """Any share count against torch's team size (2 here, or what the machine has): the
    same bits as the pool path, and the float64 reference."""
    step = _step(workers, [700, 1030, 5, 64])
    out_omp, lse_omp = _decode(step, workers, True)
    out_pool, lse_pool = _decode(step, workers, False)
    assert torch.equal(out_omp, out_pool) and torch.equal(lse_omp, lse_pool)
    ref, ref_lse = reference_decode(step[0], step[1], step[2], step[3].tolist(), 512, 0.06)
    assert (out_omp.double() - ref).abs().max() < 4e-2
    assert (lse_omp.permute(2, 0, 1).double() - ref_lse).abs().max() < 1e-4


@needs_openmp
def test_threads_with_their_own_teams_at_once() -> None:
    """Python threads calling at once each get their own OpenMP team and scratch."""
    steps = [_step(10 + t, [300 + 50 * t, 900], dtype=torch.float32) for t in range(3)]
    expected = [_decode(s, 2, False) for s in steps]
    bad: list[int] = []

    def work(t: int) -> None:
        for _ in range(4):
            out, lse = _decode(steps[t], 2, True)
            if not (torch.equal(out, expected[t][0]) and torch.equal(lse, expected[t][1])):
                bad.append(t)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert bad == []


@pytest.mark.usefixtures("fresh_libraries")
def test_switched_off_runs_on_the_pool_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(openmp.OPENMP_ENV, "0")
    status, how = cpu_mla.decode_kernel_status()
    assert f"turned off by {openmp.OPENMP_ENV}=0" in how
    assert status.available == CpuMLADecodeBackend.is_available()
    if status.available:
        kernel = cpu_mla.load_decode_kernel()
        assert kernel is not None and not kernel.openmp
        assert status.path is not None and status.path.name.startswith("mla_decode_cpu-")
        with pytest.raises(ValueError, match="openmp needs the library built with OpenMP"):
            _decode(_step(1, [40]), 2, True)
        out, _ = _decode(_step(1, [40]), 2, False)
        assert torch.isfinite(out.float()).all()
    monkeypatch.setenv(openmp.OPENMP_ENV, "maybe")
    with pytest.raises(ValueError, match="APP_CPU_DECODE_OPENMP: expected one of"):
        cpu_mla.decode_kernel_status()


@pytest.mark.usefixtures("fresh_libraries")
def test_another_openmp_runtime_falls_back_to_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch on Intel's libiomp5 (faked): the OpenMP build is not even built."""
    monkeypatch.setattr(openmp, "_loaded_openmp_runtimes",
                        lambda: [Path("/opt/intel/lib/libiomp5.so")])
    status, how = cpu_mla.decode_kernel_status()
    assert "torch's OpenMP runtime is not libgomp.so.1 (libiomp5.so)" in how
    assert status.available == CpuMLADecodeBackend.is_available()
    assert cpu_mla.SPEC_OPENMP.switches == (*cpu_mla.SPEC.switches, openmp.OPENMP_ENV)
    assert "-fopenmp" in cpu_mla.SPEC_OPENMP.flags and "-fopenmp" not in cpu_mla.SPEC.flags


@needs_openmp
def test_a_forked_child_decodes_after_the_parent_did() -> None:
    """GCC's libgomp cannot run a parallel region in a forked child of a process that ran
    one (its team's threads are not there: torch's own ops hang too), so a child decodes on
    the package's pool; the parent's result, within a timeout."""
    step = _step(4, [500, 900])
    parent = _decode(step, 2, True)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            kernel = cpu_mla.load_decode_kernel()
            q, cache, table, seq_lens = step
            plan = plan_decode(seq_lens.tolist(), 2, min_keys_per_part=64)
            out = torch.empty(*q.shape[:3], 512, dtype=q.dtype)
            lse = torch.empty(*q.shape[:3])
            assert kernel is not None and not openmp.same_process()
            kernel.run(plan, q, cache, table, seq_lens, 512, out, lse, 0.06, 1.0)
            os.write(write_end, pickle.dumps((out.view(torch.int16).tolist(), lse.tolist())))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = b""
        while select.select([read_end], [], [], 60)[0]:
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                break
            data += chunk
        else:
            pytest.fail("the forked child did not finish its decode step in 60 s")
    finally:
        os.close(read_end)
        if os.waitpid(pid, os.WNOHANG)[0] == 0:   # still running: a hang
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert data, "the forked child failed before it sent its result"
    out_list, lse_list = pickle.loads(data)
    assert torch.equal(torch.tensor(out_list, dtype=torch.int16).view(torch.bfloat16),
                       parent[0])
    assert torch.equal(torch.tensor(lse_list), parent[1])
