"""The conformance kit itself: it passes a correct backend and catches broken ones."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

import pytest
import torch

from app._types import DeviceCapability
from app.backends.prefill.base import MLAPrefillSelectorConfig
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.testing import (
    CASES,
    ConformanceReport,
    assert_conformance,
    reference_attention,
    run_conformance,
)


class Base2Lse(TorchSDPABackend):
    """Forgets to convert a base-2 LSE (the classic bug)."""

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        out, lse = super()._run(*args, **kwargs)
        return out, (None if lse is None else lse / math.log(2.0))


class ZeroLseForEmptyRows(TorchSDPABackend):
    """Passes the aten CPU kernel's LSE 0 through for rows that see no key."""

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        out, lse = super()._run(*args, **kwargs)
        return out, (None if lse is None else torch.nan_to_num(lse, neginf=0.0))


class TopLeftCausal(TorchSDPABackend):
    """Aligns the causal mask top-left when kv_len > q_len."""

    def _launch(self, call: int, layout: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: Any) -> None:
        self._run_dense_top_left(layout, q, k, v, causal, out, lse)

    def _run_dense_top_left(self, layout: Any, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, causal: bool, out: torch.Tensor,
                            lse: torch.Tensor) -> None:
        for qs, ks, ql, kl in zip(layout.q_starts, layout.kv_starts, layout.q_lens,
                                  layout.kv_lens, strict=True):
            if ql == 0:
                continue
            s = torch.einsum("qhd,khd->hqk", q[qs:qs + ql].float(), k[ks:ks + kl].float())
            s = s * self.scale
            if causal:
                s = s.masked_fill(torch.ones(ql, kl, dtype=torch.bool).triu(1), -math.inf)
            lg = torch.logsumexp(s, -1)
            p = torch.exp(s - lg[..., None]).nan_to_num(0.0)
            out[qs:qs + ql] = torch.einsum("hqk,khd->qhd", p, v[ks:ks + kl].float())
            lse[:, qs:qs + ql] = lg


class IgnoresOut(TorchSDPABackend):
    def _run(self, call: int, layout: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             causal: bool, out: Any, want_lse: bool) -> Any:
        return super()._run(call, layout, q, k, v, causal, None, want_lse)


class RejectsStridedV(TorchSDPABackend):
    def _run(self, call: int, layout: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             causal: bool, out: Any, want_lse: bool) -> Any:
        if not v.is_contiguous():
            raise RuntimeError("v must be contiguous")
        return super()._run(call, layout, q, k, v, causal, out, want_lse)


class GpuOnly(TorchSDPABackend):
    @classmethod
    def validate_configuration(cls, device_capability: DeviceCapability | None,
                               selector_config: MLAPrefillSelectorConfig) -> list[str]:
        return ["needs a GPU"]


def _failed(report: ConformanceReport) -> set[str]:
    return {c.name for c in report.failures}


def test_a_correct_backend_passes_and_the_report_reads_well() -> None:
    report = run_conformance(TorchSDPABackend, dtype=torch.float32)
    assert report.passed, report.format()
    assert [c.name for c in report.cases] == [c for c in CASES if c != "long_causal"]
    text = report.format()
    assert text.splitlines()[0] == "conformance of TORCH_SDPA on cpu (torch.float32): PASS"
    assert "PASS  causal_new_tokens" in text and "(tol 5e-04)" in text
    json.dumps(report.to_dict())
    assert str(report) == text


@pytest.mark.parametrize(("broken", "expected"), [
    (Base2Lse, {"causal_new_tokens", "context_chunks", "kv_longer_than_q", "q_longer_than_kv",
                "noncontiguous_v", "out_buffer", "merged_prefill"}),
    (ZeroLseForEmptyRows, {"context_chunks", "empty_context_chunk", "q_longer_than_kv",
                           "noncontiguous_v", "out_buffer", "merged_prefill"}),
    (TopLeftCausal, {"kv_longer_than_q", "q_longer_than_kv"}),
    (IgnoresOut, {"out_buffer"}),
    (RejectsStridedV, {"noncontiguous_v"}),
])
def test_broken_backends_fail_the_right_cases(broken: type[TorchSDPABackend],
                                               expected: set[str]) -> None:
    report = run_conformance(broken, dtype=torch.float32)
    assert _failed(report) == expected, report.format()
    with pytest.raises(AssertionError, match="FAIL"):
        assert_conformance(broken, dtype=torch.float32)


def test_failure_messages_say_what_went_wrong() -> None:
    report = run_conformance(ZeroLseForEmptyRows, dtype=torch.float32,
                             cases=["empty_context_chunk"])
    assert "disagree on -inf" in (report.failures[0].message or "")
    report = run_conformance(RejectsStridedV, dtype=torch.float32, cases=["noncontiguous_v"])
    assert "raised RuntimeError: v must be contiguous" in (report.failures[0].message or "")


def test_unsupported_backend() -> None:
    report = run_conformance(GpuOnly)
    assert not report.passed and report.unsupported == ("needs a GPU",)
    assert "not supported here: needs a GPU" in report.format()
    with pytest.raises(AssertionError, match="needs a GPU"):
        assert_conformance(GpuOnly)
    assert assert_conformance(GpuOnly, allow_unsupported=True).unsupported


def test_out_buffer_is_skipped_without_supports_out() -> None:
    cls: type[TorchSDPABackend] = type("NoOut", (TorchSDPABackend,), {"supports_out": False})
    report = run_conformance(cls, dtype=torch.float32, cases=["out_buffer"])
    assert report.passed and report.cases[0].skipped == "supports_out is False"


def test_tolerances_can_be_tightened_to_failure() -> None:
    report = run_conformance(TorchSDPABackend, dtype=torch.bfloat16, cases=["context_chunks"],
                             tolerances={"out": 1e-9})
    assert not report.passed and report.cases[0].out_error is not None


def test_argument_errors() -> None:
    with pytest.raises(TypeError, match="MLAPrefillBackend subclass"):
        run_conformance(object)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown case"):
        run_conformance(TorchSDPABackend, cases=["nope"])
    with pytest.raises(ValueError, match="no default tolerances"):
        run_conformance(TorchSDPABackend, dtype=torch.float64)


def test_reference_attention_bottom_right_and_empty_rows() -> None:
    q = torch.randn(3, 1, 4)
    k = torch.randn(2, 1, 4)
    v = torch.randn(2, 1, 4)
    out, lse = reference_attention(q, k, v, [0, 3], [0, 2], True, 0.5)
    assert bool(torch.isneginf(lse[0, 0])) and bool((out[0] == 0).all())
    torch.testing.assert_close(out[2].float(), (torch.softmax(
        (q[2, 0] @ k[:, 0].t()).double() * 0.5, -1) @ v[:, 0].double()).float().view(1, 4))


class _Dims(TorchSDPABackend):
    supported_mla_dimensions: ClassVar[Any] = ()


def test_dims_default_to_deepseek() -> None:
    report = run_conformance(_Dims, dtype=torch.float32, cases=["causal_new_tokens"])
    assert report.passed


def test_kit_arguments_get_typed_errors_too() -> None:
    from app.backends.prefill.torch_sdpa import TorchSDPABackend
    from app.testing import run_conformance

    with pytest.raises(ValueError, match="run_conformance: device 'tpu'"):
        run_conformance(TorchSDPABackend, device="tpu")
    with pytest.raises(ValueError, match="run_conformance: seed: expected an int in"):
        run_conformance(TorchSDPABackend, seed=2**64)
