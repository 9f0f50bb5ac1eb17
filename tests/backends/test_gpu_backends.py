"""The conformance kit on every built-in backend this GPU supports (skipped without CUDA).

Run on a GPU machine with ``python -m pytest -q -m gpu tests/backends/test_gpu_backends.py``
(see docs/gpu-results.md). A backend the GPU, dtype or installed packages rule out is skipped
with its ``validate_configuration`` reasons, so the skip list says what was not run.
"""

from __future__ import annotations

import pytest
import torch

from app._imports import import_object
from app._types import DeviceCapability, MLADimensions
from app.backends.base import MLAPrefillBackend, MLAPrefillSelectorConfig
from app.backends.merge import merge_attn_states
from app.containers import BUILTIN_MLA_PREFILL_BACKENDS
from app.testing import assert_conformance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

R1 = MLADimensions(128, 64, 128)


def _capability() -> DeviceCapability:
    major, minor = torch.cuda.get_device_capability()
    return DeviceCapability(major, minor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(BUILTIN_MLA_PREFILL_BACKENDS))
def test_backend_conforms_on_this_gpu(name: str, dtype: torch.dtype) -> None:
    cls: type[MLAPrefillBackend] = import_object(BUILTIN_MLA_PREFILL_BACKENDS[name])
    dims = R1 if not cls.supported_mla_dimensions else cls.supported_mla_dimensions[0]
    reasons = cls.validate_configuration(_capability(), MLAPrefillSelectorConfig(
        dtype=dtype, mla_dimensions=dims))
    if reasons:
        pytest.skip(f"{name} on SM{_capability().to_int()} {dtype}: {'; '.join(reasons)}")
    assert_conformance(cls, device="cuda", dtype=dtype, dims=dims, num_heads=16,
                       long_case=True)


def test_torch_sdpa_float32_on_gpu() -> None:
    cls = import_object(BUILTIN_MLA_PREFILL_BACKENDS["TORCH_SDPA"])
    assert_conformance(cls, device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_merge_matches_the_torch_merge(dtype: torch.dtype) -> None:
    pytest.importorskip("flashinfer")
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, h, d = 300, 16, 128
    a = torch.randn(t, h, d, device="cuda", generator=gen).to(dtype)
    b = torch.randn(t, h, d, device="cuda", generator=gen).to(dtype)
    la = torch.randn(h, t, device="cuda", generator=gen) * 4
    lb = torch.randn(h, t, device="cuda", generator=gen) * 4
    la[:, :10] = float("-inf")
    lb[:, 5:15] = float("-inf")
    a[:10] = 0
    b[5:15] = 0
    ref_out, ref_lse = merge_attn_states(a, la, b, lb, use_flashinfer=False)
    out, lse = merge_attn_states(a, la, b, lb, use_flashinfer=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
