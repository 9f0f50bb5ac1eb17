"""The native AVX-512 CPU kernel behind TORCH_SDPA: build, cache, fallback, exactness."""

from __future__ import annotations

import faulthandler
import math
import os
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app._cpu import avx512_emulation
from app.backends.cpu import loader as loader
from app.backends.cpu import prefill_kernel as native
from app.backends.prefill.base import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.testing import reference_attention

H = 3


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let a test change what the kernel loader sees; the real kernel is reloaded after."""
    native._reset_for_tests()
    yield
    monkeypatch.undo()
    native._reset_for_tests()


def kernel() -> native.NativeMLAPrefillKernel:
    loaded = native.load_native_kernel()
    if loaded is None:
        pytest.skip(f"native CPU kernel unavailable: {native.native_kernel_status().reasons}")
    return loaded


def test_available_wherever_nothing_rules_it_out() -> None:
    """On an x86-64 AVX-512 machine with a compiler, a failed build is a bug, not a skip."""
    status = native.native_kernel_status()
    if native._requirements() or loader.find_compiler() is None:
        assert not status.available and status.reasons
    else:
        assert status.available, status.reasons
        assert status.library is not None and status.library.is_file()


def attend(q_lens: list[int], kv_lens: list[int], causal: bool, d: int = 192, dv: int = 128,
           seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_kv = [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    q = torch.randn(cu_q[-1], H, d, generator=gen)
    k = torch.randn(cu_kv[-1], H, d, generator=gen)
    v = torch.randn(cu_kv[-1], H, dv + 64, generator=gen)[..., 64:]  # a strided view
    out = torch.full((cu_q[-1], H, dv), float("nan"))
    lse = torch.full((H, cu_q[-1]), float("nan"))
    scale = 1 / math.sqrt(d)
    kernel().attend(q, k, v, cu_q[:-1], q_lens, cu_kv[:-1], kv_lens, causal, scale, out, lse)
    ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_kv, causal, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("q_lens", "kv_lens"), [
    ([1], [1]),
    ([13, 14, 15], [13, 14, 15]),            # around one 14-row q.k register tile
    ([5, 6, 7, 20], [5, 6, 7, 20]),          # 6-row p.v tiles, one spanning two q.k tiles
    ([125, 126, 127], [125, 126, 127]),      # around one 126-row query block
    ([600], [600]),                          # more than one 512-key block
    ([40, 7], [700, 7]),                     # keys before the causal square
    ([40, 5], [10, 0]),                      # rows that see no key; a request without keys
    ([0, 9], [4, 9]),                        # a request without queries
])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_float64_reference(q_lens: list[int], kv_lens: list[int], causal: bool) -> None:
    attend(q_lens, kv_lens, causal)


@pytest.mark.parametrize(("d", "dv"), [(80, 64), (576, 512), (33, 192)])
def test_other_head_dims(d: int, dv: int) -> None:
    attend([50, 20], [50, 70], True, d=d, dv=dv)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_precision_inputs_and_outputs(in_dtype: torch.dtype, out_dtype: torch.dtype
                                           ) -> None:
    """Inputs are widened exactly and the math is float32: against float64 on the same
    (rounded) inputs the only extra error is the output's own rounding."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(90, H, 192, generator=gen).to(in_dtype)
    k = torch.randn(120, H, 192, generator=gen).to(in_dtype)
    v = torch.randn(120, H, 256, generator=gen).to(in_dtype)[..., :128]
    out, lse = torch.empty(90, H, 128, dtype=out_dtype), torch.empty(H, 90)
    kernel().attend(q, k, v, [0, 30], [30, 60], [0, 40], [40, 80], True, 0.07, out, lse)
    ref_out, ref_lse = reference_attention(q, k, v, [0, 30, 90], [0, 40, 120], True, 0.07)
    tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[out_dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    # Round to nearest even, as torch rounds: identical to converting the float32 result.
    if out_dtype != torch.float32:
        out32 = torch.empty(90, H, 128)
        kernel().attend(q, k, v, [0, 30], [30, 60], [0, 40], [40, 80], True, 0.07, out32,
                        torch.empty(H, 90))
        assert torch.equal(out, out32.to(out_dtype))


def test_thread_count_does_not_change_the_result() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(300, H, 192, generator=gen), torch.randn(300, H, 192, generator=gen)
    v = torch.randn(300, H, 128, generator=gen)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, lse = torch.empty(300, H, 128), torch.empty(H, 300)
            kernel().attend(q, k, v, [0, 100], [100, 200], [0, 100], [100, 200], True, 0.07,
                            out, lse)
            results.append((out, lse))
    finally:
        torch.set_num_threads(threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_bad_inputs_raise_before_the_kernel_runs() -> None:
    q, k, v = torch.randn(8, H, 192), torch.randn(8, H, 192), torch.randn(8, H, 128)
    out, lse = torch.empty(8, H, 128), torch.empty(H, 8)
    kern = kernel()
    with pytest.raises(ValueError, match="expected q a 3-d float32/bfloat16/float16 CPU"):
        kern.attend(q.double(), k, v, [0], [8], [0], [8], True, 0.1, out, lse)
    with pytest.raises(ValueError, match="expected k a 3-d bfloat16 CPU tensor"):
        kern.attend(q.bfloat16(), k, v, [0], [8], [0], [8], True, 0.1, out, lse)
    with pytest.raises(ValueError, match="expected lse a 2-d float32 CPU tensor"):
        kern.attend(q, k, v, [0], [8], [0], [8], True, 0.1, out, lse.bfloat16())
    with pytest.raises(ValueError, match="unit-stride last dim"):
        kern.attend(q, k.transpose(0, 2).contiguous().transpose(0, 2), v, [0], [8], [0], [8],
                    True, 0.1, out, lse)
    with pytest.raises(ValueError, match=r"expected v of shape \(8, 3, 128\)"):
        kern.attend(q, k, v[:4], [0], [8], [0], [8], True, 0.1, out, lse)
    with pytest.raises(ValueError, match="multiple of 64, got 96"):
        kern.attend(q, k, v[..., :96], [0], [8], [0], [8], True, 0.1, out[..., :96], lse)
    with pytest.raises(ValueError, match=r"request 0's kv rows \[4, 12\) are outside"):
        kern.attend(q, k, v, [0], [8], [4], [8], True, 0.1, out, lse)
    with pytest.raises(ValueError, match="as many starts as lengths"):
        kern.attend(q, k, v, [0, 4], [8], [0], [8], True, 0.1, out, lse)


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch, fresh_load: None
                                       ) -> None:
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert native.load_native_kernel() is None
    status = native.native_kernel_status()
    assert not status.available
    assert f"turned off by {native.SWITCH_ENV}=0" in status.reasons


@pytest.mark.parametrize("value", ["off", "False", " no "])
def test_other_spellings_of_off(monkeypatch: pytest.MonkeyPatch, fresh_load: None, value: str
                                ) -> None:
    monkeypatch.setenv(native.SWITCH_ENV, value)
    assert native.load_native_kernel() is None


def test_an_unrecognised_setting_raises_and_is_not_cached(
        monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    monkeypatch.setenv(native.SWITCH_ENV, "maybe")
    with pytest.raises(ValueError, match="expected one of 1/true/on/yes or 0/false/off/no"):
        native.load_native_kernel()
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert native.load_native_kernel() is None  # read again, not a cached failure


def test_a_failing_compiler_is_a_reason_not_an_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_load: None) -> None:
    if native._requirements() or loader.find_compiler() is None:
        pytest.skip("the kernel cannot build on this machine anyway")
    emulated = avx512_emulation().active
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 for --version and the build alike
    assert native.load_native_kernel() is None
    status = native.native_kernel_status()
    (reason,) = status.reasons
    if emulated:  # APP_CPU_EMULATE_AVX512: a compiler that finds no SIMDe turns it off too
        assert reason == "needs a CPU with AVX-512 (avx512f), this one has none"
        (note,) = status.notes
        assert "is set but not in effect: " in note and "does not find SIMDe" in note
        return
    assert reason.startswith("could not build or load it:") and "failed (1)" in reason


def test_built_once_into_the_cache_then_reused(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path, fresh_load: None) -> None:
    if native._requirements() or loader.find_compiler() is None:
        pytest.skip("the kernel cannot build on this machine")
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path))
    first = native.load_native_kernel()
    assert first is not None and first.path.parent == tmp_path / "cpu-kernels"
    stamp = first.path.stat().st_mtime_ns
    native._reset_for_tests()
    second = native.load_native_kernel()
    assert second is not None and second.path == first.path
    assert second.path.stat().st_mtime_ns == stamp
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no temp left


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_runs_in_a_forked_child_after_the_parent_used_it() -> None:
    """A forked engine worker inherits the pool object but not its threads."""
    kern = kernel()
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(64, H, 192, generator=gen), torch.randn(64, H, 192, generator=gen)
    v = torch.randn(64, H, 128, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the parent's call goes through the pool
    try:
        out, lse = torch.empty(64, H, 128), torch.empty(H, 64)
        kern.attend(q, k, v, [0, 32], [32, 32], [0, 32], [32, 32], True, 0.07, out, lse)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which must never return
            code = 4
            try:
                faulthandler.dump_traceback_later(60, exit=True)  # a hang fails, not blocks
                child, child_lse = torch.empty(64, H, 128), torch.empty(H, 64)
                kern.attend(q, k, v, [0, 32], [32, 32], [0, 32], [32, 32], True, 0.07, child,
                            child_lse)
                code = 0 if torch.equal(child, out) else 3
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(threads)
    assert os.waitstatus_to_exitcode(status) == 0


def test_scratch_larger_than_the_kept_size_stays_alive_during_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Scratch above SCRATCH_KEEP_BYTES is not cached: the call itself must hold it."""
    monkeypatch.setattr(native, "SCRATCH_KEEP_BYTES", 0)
    attend([300, 200], [300, 260], True)


def test_torch_sdpa_plans_once_per_step_for_every_layer(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    kern = kernel()
    plans: list[native.NativePlan] = []
    real_plan = native.NativeMLAPrefillKernel.plan

    def counting_plan(self: native.NativeMLAPrefillKernel, *a: object, **kw: object
                      ) -> native.NativePlan:
        plans.append(real_plan(self, *a, **kw))  # type: ignore[arg-type]
        return plans[-1]

    monkeypatch.setattr(native.NativeMLAPrefillKernel, "plan", counting_plan)
    be = TorchSDPABackend(num_heads=H, scale=0.07, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128)
    assert be._native_kernel(torch.float32) is kern
    gen = torch.Generator().manual_seed(5)
    for lens in ([30, 50], [7]):  # two steps, three layers each
        md = MLAPrefillMetadata.build(lens)
        be.prepare_metadata(md)
        for _ in range(3):
            q = torch.randn(md.total_q, H, 192, generator=gen)
            k = torch.randn(md.total_q, H, 192, generator=gen)
            v = torch.randn(md.total_q, H, 128, generator=gen)
            out, lse = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
            cu = md.cu_seqlens_q_cpu.tolist()
            ref_out, ref_lse = reference_attention(q, k, v, cu, cu, True, 0.07)
            torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    assert len(plans) == 2
