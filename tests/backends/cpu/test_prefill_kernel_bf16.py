"""The native CPU prefill kernel's bf16-products build (``vdpbf16ps``): accuracy against
float64, that TORCH_SDPA uses it for bf16 inputs, and the fall-backs (switch, failed
self-test). Skipped, with the reason, where it cannot run (no AVX512-BF16, no compiler)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import pytest
import torch

from app.backends.cpu import prefill_kernel_bf16 as bf16
from app.backends.cpu.prefill_kernel import load_native_kernel
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.testing import assert_conformance, reference_attention


@pytest.fixture
def kernel() -> bf16.NativeMLAPrefillKernel:
    found = bf16.load_native_bf16_kernel()
    if found is None:
        pytest.skip("bf16-products kernel unavailable here: "
                    + "; ".join(bf16.native_bf16_kernel_status().reasons))
    return found


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    bf16._reset_for_tests()
    yield
    bf16._reset_for_tests()


def _ragged(q_lens: list[int], kv_lens: list[int], heads: int, d: int, dv: int, seed: int
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, d, generator=gen).bfloat16()
    k = torch.randn(sum(kv_lens), heads, d, generator=gen).bfloat16()
    # v a view into a wider tensor, as the model's up-projection gives it
    v = torch.randn(sum(kv_lens), heads, dv + 32, generator=gen).bfloat16()[..., 32:]
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("d", "out_dtype"), [(192, torch.bfloat16), (33, torch.float32),
                                              (1, torch.float32)])
def test_matches_float64_within_bf16_tolerance(kernel: bf16.NativeMLAPrefillKernel,
                                               causal: bool, d: int,
                                               out_dtype: torch.dtype) -> None:
    # odd and even lengths, a request past one 512-key block, one with more queries than
    # keys (rows that see nothing), one with no keys at all
    q_lens, kv_lens = [1, 7, 130, 600, 9, 4], [1, 8, 131, 600, 3, 0]
    q, k, v = _ragged(q_lens, kv_lens, 2, d, 128, seed=d)
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_kv = [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    out = torch.empty(q.shape[0], 2, 128, dtype=out_dtype)
    lse = torch.empty(2, q.shape[0])
    scale = 1 / math.sqrt(d)
    kernel.attend(q, k, v, cu_q[:-1], q_lens, cu_kv[:-1], kv_lens, causal, scale, out, lse)
    ref, ref_lse = reference_attention(q, k, v, cu_q, cu_kv, causal, scale)
    torch.testing.assert_close(out.double(), ref.double(), atol=2e-2, rtol=0)
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[seen], ref_lse.double()[seen], atol=1e-3, rtol=0)
    assert torch.all(lse[~seen] == -math.inf) and torch.all(out.transpose(0, 1)[~seen] == 0)


def test_more_accurate_than_bf16_rounding_of_the_float32_result(
        kernel: bf16.NativeMLAPrefillKernel) -> None:
    """bf16 products carry only the probabilities' rounding: the error stays a few times the
    float32-math kernel's, far below what a wrong tile would give."""
    q, k, v = _ragged([300], [300], 4, 192, 128, seed=3)
    ref, _ = reference_attention(q, k, v, [0, 300], [0, 300], True, 0.07)
    f32 = load_native_kernel()
    assert f32 is not None
    errors = {}
    for name, kern in (("bf16", kernel), ("f32", f32)):
        out, lse = torch.empty(300, 4, 128), torch.empty(4, 300)
        kern.attend(q, k, v, [0], [300], [0], [300], True, 0.07, out, lse)
        errors[name] = (out.double() - ref.double()).abs().max().item()
    assert errors["f32"] < 1e-5
    assert errors["bf16"] < 1e-2  # probabilities rounded to bf16 (2^-9 relative)


def test_torch_sdpa_runs_bf16_inputs_on_it(kernel: bf16.NativeMLAPrefillKernel) -> None:
    backend = TorchSDPABackend(num_heads=2, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128)
    assert backend._native_kernel(torch.bfloat16) is kernel
    assert backend._native_kernel(torch.float32) is load_native_kernel()
    off = type("NoBF16", (TorchSDPABackend,), {"cpu_bf16_kernel": False})(
        num_heads=2, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128)
    assert off._native_kernel(torch.bfloat16) is load_native_kernel()


def test_torch_sdpa_conforms_in_bf16(kernel: bf16.NativeMLAPrefillKernel) -> None:
    assert_conformance(TorchSDPABackend, dtype=torch.bfloat16)


def test_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, fresh_loader: None) -> None:
    monkeypatch.setenv(bf16.BF16_SWITCH_ENV, "0")
    status = bf16.native_bf16_kernel_status()
    assert not status.available
    assert any(f"{bf16.BF16_SWITCH_ENV}=0" in r for r in status.reasons)
    bf16._reset_for_tests()
    monkeypatch.setenv(bf16.BF16_SWITCH_ENV, "maybe")
    with pytest.raises(ValueError, match=bf16.BF16_SWITCH_ENV):
        bf16.load_native_bf16_kernel()


def test_failed_self_test_falls_back_to_float32_math_and_says_so(
        kernel: bf16.NativeMLAPrefillKernel, monkeypatch: pytest.MonkeyPatch,
        fresh_loader: None) -> None:
    broken = attrs.evolve(bf16.SPEC_BF16, self_test=lambda library: "forced failure")
    monkeypatch.setattr(bf16, "SPEC_BF16", broken)
    status = bf16.native_bf16_kernel_status()
    assert not status.available and "forced failure" in "; ".join(status.reasons)
    backend = TorchSDPABackend(num_heads=2, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128)
    assert backend._native_kernel(torch.bfloat16) is load_native_kernel()


def test_unavailable_without_avx512_bf16(monkeypatch: pytest.MonkeyPatch,
                                         fresh_loader: None) -> None:
    from app.platforms.cpu_features import CpuFeatures

    monkeypatch.setattr(bf16, "detect_cpu_features", lambda: CpuFeatures(avx512f=True))
    status = bf16.native_bf16_kernel_status()
    assert not status.available
    assert any("AVX512-BF16" in r for r in status.reasons)


@pytest.mark.parametrize("bad", [10, 11])   # the first and the second key of a pair
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_reaches_exactly_the_rows_that_see_it(kernel: bf16.NativeMLAPrefillKernel,
                                                  bad: int, where: str) -> None:
    q, k, v = _ragged([30], [30], 1, 192, 64, seed=5)
    (k if where == "k" else v)[bad, 0, 3] = float("nan")
    out, lse = torch.empty(30, 1, 64), torch.empty(1, 30)
    kernel.attend(q, k, v, [0], [30], [0], [30], True, 0.07, out, lse)
    assert torch.isfinite(out[:bad]).all() and torch.isfinite(lse[:, :bad]).all()
    if where == "k":  # the score is NaN: the whole row and its LSE
        assert torch.isnan(out[bad:]).all() and torch.isnan(lse[:, bad:]).all()
    else:  # one value column: that column only
        assert torch.isnan(out[bad:, 0, 3]).all() and torch.isfinite(lse).all()
        others = torch.cat([out[bad:, 0, :3], out[bad:, 0, 4:]], dim=-1)
        assert torch.isfinite(others).all()
