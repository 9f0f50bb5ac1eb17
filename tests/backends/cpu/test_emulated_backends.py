"""The native CPU backends under ``APP_CPU_EMULATE_AVX512=1`` on a CPU without AVX-512: in a
fresh process with the switch set, CPU_MLA_SPARSE and CPU_MLA are available (their kernels
built with SIMDe's emulation) and a call of each agrees with TORCH_SPARSE and the float64
reference; the real CPU still reads as having no AVX-512. Skipped where the emulation cannot
take effect here (it says why: a CPU with AVX-512 of its own, no AVX2, no SIMDe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app._cpu import real_cpu_flags
from app._cpu.emulation import EMULATE_ENV, decide

#: builds the emulated kernels (minutes on a small machine, once per cache): outside the quick
#: subset (-m "not slow").
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import json
import torch
from app._cpu import avx512_emulation, cpu_flags, real_cpu_flags
from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.decode.torch_sparse import TorchSparseDecodeBackend
from app.testing import reference_decode

H, RANK, ROPE, BS, TOPK = 4, 64, 32, 4, 8
gen = torch.Generator().manual_seed(44)
report = {"emulation": avx512_emulation().line(), "real_avx512f": "avx512f" in real_cpu_flags(),
          "reported_avx512f": "avx512f" in cpu_flags(),
          "sparse_available": CpuSparseDecodeBackend.is_available(),
          "dense_available": CpuMLADecodeBackend.is_available()}
table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
lens = torch.tensor([11, 9], dtype=torch.int32)
cache = torch.randn(6, BS, RANK + ROPE, generator=gen)
q = torch.randn(2, 2, H, RANK + ROPE, generator=gen)
idx = torch.randint(0, 6 * BS, (2, 2, TOPK), generator=gen, dtype=torch.int32)
idx[0, 1, 3], idx[1, 0] = -1, -1
for dtype in (torch.float32, torch.bfloat16):
    got = {}
    for cls in (CpuSparseDecodeBackend, TorchSparseDecodeBackend):
        be = cls(H, 0.2, RANK, ROPE, dtype)
        be.prepare_metadata(MLADecodeMetadata.build(table, lens, 2))
        got[cls] = be.run_sparse_decode(q.to(dtype), cache.to(dtype), idx,
                                        return_softmax_lse=True)
    (o1, l1), (o2, l2) = got.values()
    report[f"sparse_{dtype}"] = [(o1.double() - o2.double()).abs().max().item(),
                                 (l1 - l2).abs().nan_to_num(0.0).max().item(),
                                 bool(torch.equal(l1.isinf(), l2.isinf()))]
be = CpuMLADecodeBackend(H, 0.2, RANK, ROPE, torch.float32)
be.prepare_metadata(MLADecodeMetadata.build(table, lens, 2))
out, lse = be.run_decode(q, cache, return_softmax_lse=True)
want, want_lse = reference_decode(q, cache, table, lens.tolist(), RANK, 0.2, 1.0)
report["dense"] = [(out.double() - want).abs().max().item(),
                   (lse.double() - want_lse).abs().max().item()]
print(json.dumps(report))
"""


def test_the_native_backends_run_emulated_and_agree_with_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")
    state = decide(real_cpu_flags())
    if not state.active:
        pytest.skip(state.reason)
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=1800, check=False, cwd=ROOT,
                          env={**os.environ, EMULATE_ENV: "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["emulation"].startswith("EMULATED by SIMDe "), report
    assert not report["real_avx512f"] and report["reported_avx512f"], report
    assert report["sparse_available"] and report["dense_available"], report
    out_err, lse_err, same_empty_rows = report["sparse_torch.float32"]
    assert out_err < 1e-4 and lse_err < 1e-4 and same_empty_rows, report
    out_err, lse_err, same_empty_rows = report["sparse_torch.bfloat16"]
    assert out_err < 3e-2 and lse_err < 3e-2 and same_empty_rows, report
    assert report["dense"][0] < 1e-4 and report["dense"][1] < 1e-4, report
