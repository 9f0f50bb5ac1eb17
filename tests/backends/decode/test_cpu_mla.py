"""CPU_MLA: the native decode kernel through the conformance kit, its work split, its
thread safety and its refusals. Skipped where the kernel cannot be built (no AVX-512 / C
compiler); the reason it gives is checked everywhere."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from app._types import MLADimensions
from app.backends.cpu import amx, decode_kernel
from app.backends.cpu.decode_kernel_amx import amx_decode_status
from app.backends.cpu.loader import load_native_library, reset_native_libraries
from app.backends.decode import cpu_mla as cpu_mla_decode
from app.backends.decode.cpu_mla import CpuMLADecodeBackend, plan_decode
from app.testing import assert_decode_conformance, reference_decode

needs_kernel = pytest.mark.skipif(not CpuMLADecodeBackend.is_available(),
                                  reason="the native decode kernel cannot run here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_mla_conforms(dtype: torch.dtype) -> None:
    assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=dtype)


def test_plan_splits_long_requests_and_balances() -> None:
    plan = plan_decode([32768], 4)                   # one request, four workers: 4 parts
    assert plan.parts == 4 and len(plan.shares) == 4
    assert plan.merge.tolist() == [[0, 0, 4]]
    ranges = sorted(tuple(s[0, 1:3].tolist()) for s in plan.shares)
    assert ranges[0][0] == 0 and ranges[-1][1] == 32768
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    plan = plan_decode([4096] * 64, 2)               # many equal requests: no split
    assert plan.parts == 0 and [s.shape[0] for s in plan.shares] == [32, 32]
    plan = plan_decode([100, 30000, 50, 60], 2)      # one long request among short ones
    assert plan.parts == 2
    loads = [int((s[:, 2] - s[:, 1]).sum()) for s in plan.shares]
    assert max(loads) - min(loads) < 1000
    assert plan_decode([3], 8).parts == 0            # short requests are never split
    assert len(plan_decode([], 2).shares) == 0


@needs_kernel
def test_split_requests_match_the_reference() -> None:
    kernel = cpu_mla_decode.load_decode_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    lens, bs, heads, qlen = [700, 1030, 5], 16, 16, 3
    blocks = [-(-n // bs) for n in lens]
    table = torch.full((3, max(blocks)), -1, dtype=torch.int32)
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start:start + n]
        start += n
    cache = torch.randn(sum(blocks), bs, 576, generator=gen).bfloat16()
    q = torch.randn(3, qlen, heads, 576, generator=gen).bfloat16()
    ref, ref_lse = reference_decode(q, cache, table, lens, 512, 0.07, 1.5)
    plan = plan_decode(lens, 5, min_keys_per_part=64)
    assert plan.parts >= 5
    out = torch.empty(3, qlen, heads, 512, dtype=torch.bfloat16)
    lse = torch.empty(3, qlen, heads)
    kernel.run(plan, q, cache, table, torch.tensor(lens, dtype=torch.int32), 512, out, lse,
               0.07, 1.5)
    assert (out.double() - ref).abs().max() < 4e-2
    assert (lse.permute(2, 0, 1).double() - ref_lse).abs().max() < 1e-4


@needs_kernel
def test_concurrent_calls_from_many_threads() -> None:
    """Several threads decode different steps at once through the shared worker pool."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(64, 16, 576, generator=gen).bfloat16()
    jobs = []
    for t in range(4):
        lens = [int(x) for x in torch.randint(1, 900, (1 + t,), generator=gen)]
        table = torch.stack([torch.randperm(64, generator=gen)[:57] for _ in range(1 + t)]) \
            .to(torch.int32)                           # pages shared between requests
        q = torch.randn(1 + t, 1, 16, 576, generator=gen).bfloat16()
        jobs.append((lens, table, q, reference_decode(q, cache, table, lens, 512, 0.05)))
    errors: list[float] = []

    def work(lens: list[int], table: torch.Tensor, q: torch.Tensor,
             ref: tuple[torch.Tensor, torch.Tensor]) -> None:
        be = CpuMLADecodeBackend(16, 0.05, 512, 64, torch.bfloat16)
        for _ in range(5):
            be.prepare_metadata(table, torch.tensor(lens, dtype=torch.int32), 1)
            out, lse = be.run_decode(q, cache, return_softmax_lse=True)
            errors.append(float((lse.double() - ref[1]).abs().max()))
            errors.append(float((out.double() - ref[0]).abs().max()) / 10)

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(errors) == 40 and max(errors) < 4e-3


def test_declarations_and_refusals() -> None:
    assert CpuMLADecodeBackend.get_name() == "CPU_MLA"
    assert CpuMLADecodeBackend.supports_block_size(7)
    assert CpuMLADecodeBackend.supports_mla_dimensions(MLADimensions(kv_lora_rank=512,
                                                                      qk_rope_head_dim=64))
    assert not CpuMLADecodeBackend.supports_mla_dimensions(MLADimensions(kv_lora_rank=500,
                                                                          qk_rope_head_dim=64))
    if CpuMLADecodeBackend.is_available():
        with pytest.raises(ValueError, match="multiple of 64"):
            CpuMLADecodeBackend(16, 0.1, 96, 64, torch.bfloat16)


def test_switched_off_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_CPU_NATIVE_KERNEL", "0")
    names = (cpu_mla_decode.SPEC.name, cpu_mla_decode.SPEC_OPENMP.name)
    for name in names:
        reset_native_libraries(name)
    try:
        assert not CpuMLADecodeBackend.is_available()
        assert "APP_CPU_NATIVE_KERNEL=0" in CpuMLADecodeBackend.unavailable_reason()
        assert not load_native_library(cpu_mla_decode.SPEC).available
        assert not load_native_library(cpu_mla_decode.SPEC_OPENMP).available
    finally:
        monkeypatch.delenv("APP_CPU_NATIVE_KERNEL")
        for name in names:
            reset_native_libraries(name)


@needs_kernel
def test_bf16_float32_path_conforms_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bf16 dot products switched off (or absent), bf16 runs the float32 path (AMX
    pinned off: on an AMX CPU bf16 would run on the tiles instead, issue 43)."""
    monkeypatch.setenv(amx.AMX_ENV, "0")
    monkeypatch.setenv(cpu_mla_decode.BF16_DOT_ENV, "0")
    assert not cpu_mla_decode.has_bf16_dot()
    assert_decode_conformance(CpuMLADecodeBackend, device="cpu", dtype=torch.bfloat16,
                              cases=["paged", "causal_query_len_4", "batch_1",
                                     "nonfinite_keys"])


@needs_kernel
def test_bf16_dot_needs_bf16_q_and_cache() -> None:
    kernel = cpu_mla_decode.load_decode_kernel()
    assert kernel is not None
    q = torch.randn(1, 1, 2, 576)
    cache = torch.randn(2, 16, 576).bfloat16()
    with pytest.raises(ValueError, match="bf16_dot needs"):
        kernel.run(plan_decode([5], 1), q, cache, torch.zeros(1, 1, dtype=torch.int32),
                   torch.tensor([5], dtype=torch.int32), 512, torch.empty(1, 1, 2, 512),
                   None, 0.1, 1.0, bf16_dot=True)


@needs_kernel
def test_a_backend_looks_its_kernel_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel and the bf16 switch are resolved at a backend's first run, not on every
    layer of every step; a backend made after the switch changes sees the new value. AMX is
    pinned off: on an AMX CPU both backends would run bf16 on the tiles, where the switch
    means nothing (issue 43), and the two results would not differ."""
    monkeypatch.setenv(amx.AMX_ENV, "0")
    assert not amx_decode_status().available
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(8, 16, 576, generator=gen).bfloat16()
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    lens = torch.tensor([50, 17], dtype=torch.int32)
    q = torch.randn(2, 1, 16, 576, generator=gen).bfloat16()
    ref = reference_decode(q, cache, table, lens.tolist(), 512, 0.05)

    def decode(be: CpuMLADecodeBackend) -> torch.Tensor:
        be.prepare_metadata(table, lens, 1)
        return be.run_decode(q, cache)

    first = CpuMLADecodeBackend(16, 0.05, 512, 64, torch.bfloat16)
    decode(first)
    calls: list[int] = []
    real = cpu_mla_decode.load_decode_kernel
    monkeypatch.setattr(cpu_mla_decode, "load_decode_kernel",
                        lambda: calls.append(1) or real())
    monkeypatch.setenv(cpu_mla_decode.BF16_DOT_ENV, "0")
    kept = decode(first)                              # still its first lookup (and dot path)
    assert calls == []
    fresh = decode(CpuMLADecodeBackend(16, 0.05, 512, 64, torch.bfloat16))
    assert calls == [1]
    for out in (kept, fresh):
        assert float((out.double() - ref[0]).abs().max()) < 4e-2
    if decode_kernel._cpu_has_bf16_dot():            # the two paths round differently
        assert not torch.equal(kept, fresh)
