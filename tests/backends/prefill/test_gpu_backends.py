"""The conformance kit on every backend this GPU supports (skipped without CUDA), taken from a
container on the detected platform (built-ins and any registered by plugins), run with the
platform's device capability as the container passes it.

Run on a GPU machine with ``python -m pytest -q -m gpu tests/backends/prefill/test_gpu_backends.py``
(see docs/gpu-results.md). A backend the GPU, dtype or installed packages rule out is skipped
with its ``validate_configuration`` reasons, so the skip list says what was not run.
"""

from __future__ import annotations

import pytest
import torch

from app._types import DeviceCapability, MLADimensions
from app.backends.merge import merge_attn_states
from app.backends.prefill.base import MLAPrefillBackend, MLAPrefillSelectorConfig
from app.containers import Application, create_container
from app.seed_api import MLAPrefillBackendEnum
from app.testing import assert_conformance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

R1 = MLADimensions(128, 64, 128)


def _container() -> Application:
    return create_container()  # the detected platform, general plugins applied


def _capability(container: Application) -> DeviceCapability:
    capability: DeviceCapability | None = container.platform().get_device_capability()
    if capability is None:
        pytest.skip("the detected platform is not a GPU")
    return capability


def _class(container: Application, name: str) -> type[MLAPrefillBackend]:
    try:
        cls: type[MLAPrefillBackend] = getattr(container.mla_prefill_backends, name)()
    except ImportError as exc:
        pytest.skip(f"{name}: {exc}")
    if cls is None:
        pytest.skip(f"{name} is not registered")
    return cls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MLAPrefillBackendEnum.__members__))
def test_backend_conforms_on_this_gpu(name: str, dtype: torch.dtype) -> None:
    container = _container()
    cls = _class(container, name)
    capability = _capability(container)
    dims = R1 if not cls.supported_mla_dimensions else cls.supported_mla_dimensions[0]
    reasons = cls.validate_configuration(capability, MLAPrefillSelectorConfig(
        dtype=dtype, mla_dimensions=dims))
    if reasons:
        pytest.skip(f"{name} on SM{capability.to_int()} {dtype}: {'; '.join(reasons)}")
    assert_conformance(cls, device="cuda", dtype=dtype, dims=dims, num_heads=16,
                       long_case=True, device_capability=capability)


def test_torch_sdpa_float32_on_gpu() -> None:
    container = _container()
    assert_conformance(_class(container, "TORCH_SDPA"), device="cuda", dtype=torch.float32,
                       device_capability=_capability(container))


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
