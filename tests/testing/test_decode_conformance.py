"""The decode conformance kit itself: it passes a correct backend and catches broken ones."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from app.backends.decode.base import DecodeMetadata
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend, decode_one_request
from app.testing import DECODE_CASES, reference_decode, run_decode_conformance

#: runs the decode conformance kit many times: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow


class NoCausalMask(TorchSDPADecodeBackend):
    """Lets every query row of the step see every new token."""

    def _run_decode(self, metadata: DecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        bs = kv_cache.shape[1]
        for b, n in enumerate(metadata.seq_lens_list):
            pos = torch.arange(n)
            latent = kv_cache[metadata.block_table_cpu[b].long()[pos // bs], pos % bs]
            for i in range(q.shape[1]):
                o, lg = decode_one_request(q[b, i:i + 1], latent, self.kv_lora_rank,
                                           softmax_scale * k_scale, k_scale)
                out[b, i] = o[0]
                if lse is not None:
                    lse[b, i] = lg[0]


class CachesScales(TorchSDPADecodeBackend):
    """Keeps the first call's scales (the TokenSpeed review's defect)."""

    cached: ClassVar[dict[int, tuple[float, float]]] = {}

    def _run_decode(self, metadata: DecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        scales = self.cached.setdefault(id(self), (softmax_scale, k_scale))
        super()._run_decode(metadata, q, kv_cache, out, lse, *scales)


class ReadsWholeBlocks(TorchSDPADecodeBackend):
    """Attends every row of the last block, past seq_len."""

    def _run_decode(self, metadata: DecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        bs = kv_cache.shape[1]
        for b, n in enumerate(metadata.seq_lens_list):
            pos = torch.arange(-(-n // bs) * bs)
            latent = kv_cache[metadata.block_table_cpu[b].long()[pos // bs], pos % bs]
            o, lg = decode_one_request(q[b], latent, self.kv_lora_rank,
                                       softmax_scale * k_scale, k_scale)
            out[b].copy_(o)
            if lse is not None:
                lse[b].copy_(lg)


class NoLse(TorchSDPADecodeBackend):
    """Returns a base-2 LSE."""

    def _run_decode(self, metadata: DecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        super()._run_decode(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)
        if lse is not None:
            lse.mul_(1.4426950408889634)


class ReadsCallersTensors(TorchSDPADecodeBackend):
    """Reads the block table and seq_lens the caller gave (not the checked snapshots), as the
    native kernel did before issue 21: a caller reusing its buffers changes the step."""

    def _run_decode(self, metadata: DecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        bs = int(kv_cache.shape[1])
        for b, n in enumerate(metadata.seq_lens.tolist()):
            blocks = metadata.block_table[b, :-(-n // bs)].long()
            latent = kv_cache.index_select(0, blocks).reshape(-1, self.head_dim)[:n]
            o, lg = decode_one_request(q[b], latent, self.kv_lora_rank,
                                       softmax_scale * k_scale, k_scale)
            out[b].copy_(o)
            if lse is not None:
                lse[b].copy_(lg)


def _failed(cls: type[TorchSDPADecodeBackend], cases: list[str]) -> set[str]:
    report = run_decode_conformance(cls, dtype=torch.float32, num_heads=4, kv_lora_rank=32,
                                    qk_rope_head_dim=8, cases=cases)
    return {c.name for c in report.failures}


def test_kit_passes_torch_sdpa_with_small_dims() -> None:
    report = run_decode_conformance(TorchSDPADecodeBackend, dtype=torch.float32, num_heads=4,
                                    kv_lora_rank=32, qk_rope_head_dim=8)
    assert report.passed, report.format()
    assert [c.name for c in report.cases] == list(DECODE_CASES)


def test_kit_catches_broken_backends() -> None:
    assert _failed(NoCausalMask, ["paged", "causal_query_len_4"]) == {"causal_query_len_4"}
    assert _failed(CachesScales, ["paged", "scales_per_call"]) == {"scales_per_call"}
    assert _failed(ReadsWholeBlocks, ["paged", "batch_33"]) == {"paged", "batch_33"}
    assert _failed(NoLse, ["batch_1"]) == {"batch_1"}
    assert _failed(ReadsCallersTensors, ["paged", "reused_step_buffers"]) == {
        "reused_step_buffers"}


def test_kit_reports_unsupported_and_bad_arguments() -> None:
    report = run_decode_conformance(TorchSDPADecodeBackend, dtype=torch.float64,
                                    tolerances={"out": 1e-9, "lse": 1e-9})
    assert not report.passed and "dtype torch.float64 not supported" in report.format()
    with pytest.raises(TypeError, match="MLADecodeBackend subclass"):
        run_decode_conformance(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown case"):
        run_decode_conformance(TorchSDPADecodeBackend, cases=["nope"])


def test_reference_decode_matches_a_dense_computation() -> None:
    cache = torch.randn(3, 2, 6, dtype=torch.float64)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    q = torch.randn(1, 2, 1, 6, dtype=torch.float64)
    out, lse = reference_decode(q, cache, table, [5], 4, 0.5)
    keys = torch.cat([cache[2], cache[0], cache[1]])[:5]
    s0 = (q[0, 0, 0] @ keys[:4].t()) * 0.5            # row 0 sees keys 0..3
    assert torch.allclose(lse[0, 0, 0], torch.logsumexp(s0, 0))
    assert torch.allclose(out[0, 0, 0], torch.softmax(s0, 0) @ keys[:4, :4])


@pytest.mark.parametrize("kwargs, error, message", [
    ({"device": "tpu"}, ValueError, "run_decode_conformance: device 'tpu': Expected one of"),
    ({"device": 3j}, TypeError, "device must be a name ('cpu', 'cuda:0') or a torch.device"),
    ({"seed": 2**70}, ValueError, "run_decode_conformance: seed: expected an int in [0, "),
    ({"seed": -1}, ValueError, "run_decode_conformance: seed: expected an int in [0, "),
])
def test_kit_arguments_get_typed_errors(kwargs: dict[str, object], error: type[Exception],
                                        message: str) -> None:
    # issue 21: "tpu" was a bare RuntimeError, 2**70 "Overflow when unpacking long long".
    with pytest.raises(error) as info:
        run_decode_conformance(TorchSDPADecodeBackend, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_kit_on_cuda_without_cuda_says_so() -> None:
    # It was an AssertionError from torch ("Torch not compiled with CUDA enabled").
    with pytest.raises(ValueError, match="device 'cuda': CUDA is not available here"):
        run_decode_conformance(TorchSDPADecodeBackend, device="cuda")


def test_both_kits_return_their_report_from_one_runner() -> None:
    from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend
    from app.testing import (
        CaseFailure,
        ConformanceReport,
        assert_conformance,
        assert_decode_conformance,
        run_cases,
    )

    decode = assert_decode_conformance(TorchSDPADecodeBackend, dtype=torch.float32,
                                       num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                                       cases=["paged"])
    prefill = assert_conformance(TorchSDPAPrefillBackend, dtype=torch.float32,
                                 cases=["causal_new_tokens"])
    for report in (decode, prefill):
        assert isinstance(report, ConformanceReport) and report.passed

    class Kit:
        def good(self, errors: dict[str, float]) -> None:
            errors["out"] = 1e-6

        def wrong(self, errors: dict[str, float]) -> None:
            raise CaseFailure("LSE in base 2")

        def crashes(self, errors: dict[str, float]) -> None:
            raise RuntimeError("kernel died")

    report = run_cases(Kit(), ["good", "wrong", "crashes", "skipped"], backend="KIT",
                       device=torch.device("cpu"), dtype=torch.float32,
                       tolerances={"out": 1e-3, "lse": 1e-3}, skipped={"skipped": "why not"})
    assert [(c.name, c.passed) for c in report.cases] == [
        ("good", True), ("wrong", False), ("crashes", False), ("skipped", True)]
    assert report.cases[1].message == "LSE in base 2"
    assert (report.cases[2].message or "").startswith("raised RuntimeError: kernel died")
    assert report.cases[3].skipped == "why not" and not report.passed
