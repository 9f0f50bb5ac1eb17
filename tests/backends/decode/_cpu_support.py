"""Shared by the hostile-input tests of the CPU decode backends: the backends to run (CPU_MLA
where its native kernel can run here) and the latent dims they use."""

from __future__ import annotations

import pytest

from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend

RANK, ROPE, HEADS, BS, NUM_BLOCKS = 64, 32, 4, 16, 8

BACKENDS = [
    pytest.param(TorchSDPADecodeBackend, id="TORCH_SDPA"),
    pytest.param(CpuMLADecodeBackend, id="CPU_MLA", marks=pytest.mark.skipif(
        not CpuMLADecodeBackend.is_available(), reason="the native decode kernel cannot run "
        "here")),
]
