"""The prefill contract's template lives in ``MLAPrefillBackend``: a third-party backend built
on it alone (as the README shows) is checked as the built-ins are, whether it implements the
kernel hook ``_run_prefill`` or, the old way, the run verbs themselves."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from app.backends import MLAPrefillBackend, MLAPrefillMetadata
from app.backends.prefill import (
    flash_attn,
    flashinfer,
    kernel_base,
    tokenspeed_mla,
    torch_sdpa,
    trtllm_ragged,
)
from app.backends.prefill import metadata as prefill_metadata
from app.backends.prefill.metadata import RaggedLayout, StepLayouts
from app.testing import reference_attention, run_conformance

H, DQK, DV = 2, 12, 8


def _attend(layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = reference_attention(q, k, v, [0, *itertools.accumulate(layout.q_lens)],
                                   [0, *itertools.accumulate(layout.kv_lens)], causal, scale)
    return out.to(q.dtype), lse.float()


class HookBackend(MLAPrefillBackend):
    """A third party's backend the new way: only the kernel hook (plain float64 math)."""

    name = "TEST_HOOK"
    supported_dtypes = (torch.float32,)
    supports_out = True
    calls: list[str] = []

    def _run_prefill(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                     ) -> None:
        self.calls.append(f"hook {call}")
        o, lg = _attend(layout, q, k, v, causal, self.scale)
        out.copy_(o)
        if lse is not None:
            lse.copy_(lg)


class VerbsBackend(MLAPrefillBackend):
    """A third party's backend the README's old way: the run verbs themselves."""

    name = "TEST_VERBS"
    supported_dtypes = (torch.float32,)
    calls: list[str] = []
    transpose_lse = False

    def _layout(self, chunk: int | None) -> RaggedLayout:
        step = StepLayouts.from_metadata(self.metadata, "test")
        return step.new_tokens if chunk is None else step.chunks[chunk]

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> Any:
        self.calls.append(f"new out={out is not None}")
        o, lg = _attend(self._layout(None), q, k, v, True, self.scale)
        lg = lg.t().contiguous().t()       # [H, T] values, non-contiguous
        if self.transpose_lse:
            lg = lg.t()
        return (o, lg) if return_softmax_lse else o

    def run_prefill_context_chunk(self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        self.calls.append(f"chunk {chunk_idx}")
        return _attend(self._layout(chunk_idx), q, k, v, False, self.scale)


def _build(cls: type[MLAPrefillBackend]) -> MLAPrefillBackend:
    return cls(num_heads=H, scale=0.3, kv_lora_rank=16, qk_nope_head_dim=DQK - 4,
               qk_rope_head_dim=4, v_head_dim=DV)


def _inputs(tokens: int, kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(tokens, H, DQK, generator=gen), torch.randn(kv, H, DQK, generator=gen),
            torch.randn(kv, H, DV, generator=gen))


@pytest.mark.parametrize("cls", [HookBackend, VerbsBackend])
def test_a_third_party_backend_gets_every_check_before_its_code_runs(
        cls: type[MLAPrefillBackend]) -> None:
    be = _build(cls)
    q, k, v = _inputs(7, 7)
    with pytest.raises(ValueError, match="call prepare_metadata"):
        be.run_prefill_new_tokens(q, k, v, True)
    be.prepare_metadata(MLAPrefillMetadata.build([3, 4], [[2, 0]]))
    cls.calls.clear()  # type: ignore[attr-defined]
    bad: list[tuple[str, Any]] = [
        (r"q tokens \(dim 0\): expected 7, got 6", lambda: be.run_prefill_new_tokens(
            q[:6], k, v, True)),
        (r"k head dim \(dim 2\): expected 12, got 11", lambda: be.run_prefill_new_tokens(
            q, k[..., :11], v, True)),
        (r"q dtype: expected one of \['torch.float32'\], got torch.float64",
         lambda: be.run_prefill_new_tokens(q.double(), k.double(), v.double(), True)),
        (r"out shape: expected \[7, 2, 8\], got \[7, 2, 4\]", lambda: be.run_prefill_new_tokens(
            q, k, v, True, out=torch.empty(7, H, 4))),
        ("return_softmax_lse must be a bool", lambda: be.run_prefill_new_tokens(
            q, k, v, "yes")),
        (r"context chunk index must be in \[0, 1\), got 1", lambda: be.run_prefill_context_chunk(
            1, q, k[:2], v[:2])),
        (r"k tokens \(dim 0\): expected 2, got 7", lambda: be.run_prefill_context_chunk(
            0, q, k, v)),
    ]
    for message, call in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    assert cls.calls == []  # type: ignore[attr-defined]  # refused before the backend's code


@pytest.mark.parametrize("cls", [HookBackend, VerbsBackend])
def test_out_and_the_lse_layout_are_the_bases_whatever_the_subclass(
        cls: type[MLAPrefillBackend]) -> None:
    be = _build(cls)
    md = MLAPrefillMetadata.build([3, 4], [[2, 0]])
    be.prepare_metadata(md)
    q, k, v = _inputs(7, 7)
    ref_out, ref_lse = reference_attention(q, k, v, [0, 3, 7], [0, 3, 7], True, 0.3)
    out, lse = be.run_prefill_new_tokens(q, k, v, True)
    assert lse.shape == (H, 7) and lse.is_contiguous() and lse.dtype == torch.float32
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    # an out= that is q's own memory: written after the backend's code, never during it
    shared = torch.zeros(7 * H * DQK)
    q_view = shared.view(7, H, DQK)
    q_view.copy_(q)
    out_in_q = shared[:7 * H * DV].view(7, H, DV)
    got = be.run_prefill_new_tokens(q_view, k, v, False, out=out_in_q)
    assert got is out_in_q and torch.allclose(out_in_q.double(), ref_out, atol=1e-5)
    # the chunk's empty request (no cached tokens) gets out 0 and LSE -inf
    c_out, c_lse = be.run_prefill_context_chunk(0, q, k[:2], v[:2])
    assert bool(torch.isneginf(c_lse[:, 3:]).all()) and bool((c_out[3:] == 0).all())


def test_an_lse_in_the_wrong_layout_is_refused() -> None:
    be = _build(VerbsBackend)
    be.prepare_metadata(MLAPrefillMetadata.build([3, 4]))
    q, k, v = _inputs(7, 7)
    VerbsBackend.transpose_lse = True
    try:
        with pytest.raises(TypeError, match=r"expected \(out, lse\) with lse \[2, 7\] float32"):
            be.run_prefill_new_tokens(q, k, v, True)
    finally:
        VerbsBackend.transpose_lse = False


@pytest.mark.parametrize("cls", [HookBackend, VerbsBackend])
def test_both_ways_pass_the_conformance_kit(cls: type[MLAPrefillBackend]) -> None:
    report = run_conformance(cls, dtype=torch.float32, num_heads=2,
                             cases=["causal_new_tokens", "context_chunks", "q_longer_than_kv",
                                    "out_buffer", "merged_prefill"])
    assert report.passed, report.format()


def test_a_class_that_implements_neither_way_stays_abstract() -> None:
    class Nothing(MLAPrefillBackend):
        name = "NOTHING"

    class OneVerb(MLAPrefillBackend):
        name = "ONE_VERB"

        def run_prefill_new_tokens(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    for cls in (Nothing, OneVerb):
        with pytest.raises(TypeError, match="abstract"):
            _build(cls)
    assert not getattr(VerbsBackend._run_prefill, "__isabstractmethod__", False)


def test_the_step_hook_is_prepare_step_and_the_old_name_still_runs() -> None:
    seen: list[str] = []

    class NewHook(HookBackend):
        def _prepare_step(self, layouts: StepLayouts) -> None:
            seen.append(f"new {layouts.new_tokens.total_q}")

    with pytest.warns(DeprecationWarning, match="_on_prepare: the step hook is named "
                                                "_prepare_step"):
        class OldHook(HookBackend):
            def _on_prepare(self, layouts: StepLayouts) -> None:
                seen.append(f"old {layouts.new_tokens.total_q}")

    for cls in (NewHook, OldHook):
        _build(cls).prepare_metadata(MLAPrefillMetadata.build([3, 4]))
    assert seen == ["new 7", "old 7"]


def test_class_names_say_their_kind_and_the_old_names_still_work() -> None:
    pairs = [(torch_sdpa, "TorchSDPABackend", "TorchSDPAPrefillBackend", "TORCH_SDPA"),
             (flash_attn, "FlashAttnBackend", "FlashAttnPrefillBackend", "FLASH_ATTN"),
             (flashinfer, "FlashInferBackend", "FlashInferPrefillBackend", "FLASHINFER"),
             (trtllm_ragged, "TrtllmRaggedBackend", "TrtllmRaggedPrefillBackend",
              "TRTLLM_RAGGED"),
             (tokenspeed_mla, "TokenSpeedMLABackend", "TokenSpeedMLAPrefillBackend",
              "TOKENSPEED_MLA")]
    for module, old, new, name in pairs:
        cls = vars(module)[new]
        assert vars(module)[old] is cls and cls.__name__ == new and cls.get_name() == name
        assert old in module.__all__ and new in module.__all__
    # what kernel_base defined moved beside the contract; the old imports still work
    assert kernel_base.RaggedLayout is prefill_metadata.RaggedLayout
    assert kernel_base.check_cu_seqlens is prefill_metadata.check_cu_seqlens
    assert math.isclose(_build(HookBackend).scale, 0.3)
