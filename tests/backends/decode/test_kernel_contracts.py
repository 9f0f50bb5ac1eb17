"""Contracts of the GPU decode backends (FLASHINFER_MLA, TOKENSPEED_MLA), checked without a GPU.

1. ``validate_configuration`` and the constructors on pretend SM75 / SM80 / SM90 / SM100 /
   SM103 / SM107 / SM110 / SM120 GPUs, with the packages present or missing.
2. The exact arguments each backend passes are bound (``inspect.signature(...).bind``) to the
   installed flashinfer-python and tokenspeed-mla functions, and held to flashinfer's plan /
   run contract as its public API documents it (``_flashinfer_contract``: no private module,
   so a patch release that moves one breaks nothing).
3. Each backend's whole plumbing runs through the decode conformance kit on CPU with stand-in
   kernels that follow the libraries' documented conventions (``_decode_kernel_fakes``): plan
   reuse, LSE base, per-call scales, the FP8 path, workspace growth, shape checks.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch

from app._types import DeviceCapability
from app.backends.declarations import BackendDeclarations
from app.backends.decode import flashinfer_mla as fi_mod
from app.backends.decode import tokenspeed_mla as ts_mod
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.decode.flashinfer_mla import (
    FlashInferMLADecodeBackend,
    FlashInferMLAKernels,
    decode_kernel_for,
)
from app.backends.decode.tokenspeed_mla import (
    TokenSpeedMLADecodeBackend,
)
from app.testing import assert_decode_conformance, reference_decode, run_decode_conformance
from app.testing.decode_conformance import DECODE_CASES
from tests._support import kernel_packages_imported_by
from tests.backends.decode import _flashinfer_contract as public
from tests.backends.decode import _gpu_support as support
from tests.backends.decode import _kernel_fakes as fakes

SM75, SM80, SM90 = DeviceCapability(7, 5), DeviceCapability(8, 0), DeviceCapability(9, 0)
SM100, SM103, SM107 = DeviceCapability(10, 0), DeviceCapability(10, 3), DeviceCapability(10, 7)
SM110, SM120 = DeviceCapability(11, 0), DeviceCapability(12, 0)
FP8 = torch.float8_e4m3fn


def cfg(dtype: torch.dtype = torch.bfloat16, *, heads: int = 16, block_size: int = 64,
        rank: int = 512, rope: int = 64, query_len: int = 1) -> MLADecodeSelectorConfig:
    return MLADecodeSelectorConfig(dtype=dtype, kv_lora_rank=rank, qk_rope_head_dim=rope,
                                   num_heads=heads, block_size=block_size, query_len=query_len)


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> fakes.FakeFlashInferMLA:
    return support.install_fake_flashinfer(monkeypatch)


@pytest.fixture
def fake_tokenspeed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return support.install_fake_tokenspeed(monkeypatch)


def _available(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, ok: bool) -> None:
    """The kernel package installed and importing (ok) or missing, whichever is installed
    here: the probe, and the installed-package check asked where the GPU rules it out."""
    monkeypatch.setattr(module, "_probe", (lambda: object()) if ok else (lambda: None))
    monkeypatch.setattr(BackendDeclarations, "_installed", classmethod(lambda cls: ok))


# -- nothing imported at module import ----------------------------------------------------

@pytest.mark.slow
def test_kernel_packages_are_not_imported_with_the_decode_modules() -> None:
    code = "import app.backends.decode.flashinfer_mla, app.backends.decode.tokenspeed_mla\n"
    assert kernel_packages_imported_by(code) == []


# -- which kernel, and validate_configuration ---------------------------------------------

@pytest.mark.parametrize(("cap", "heads", "kernel"), [
    (SM80, 16, "fa2"), (SM90, 16, "fa3"), (SM90, 128, "fa3"), (SM100, 16, "trtllm-gen"),
    (SM103, 128, "trtllm-gen"), (SM107, 64, "trtllm-gen"), (SM100, 96, "fa2"),
    (SM110, 16, "fa2"), (SM120, 16, "fa2"), (DeviceCapability(10, 1), 16, "fa2")])
def test_flashinfer_kernel_follows_the_capability(cap: DeviceCapability, heads: int,
                                                  kernel: str) -> None:
    assert decode_kernel_for(cap, heads) == kernel


@pytest.mark.parametrize(("cap", "dtype", "bs", "expected"), [
    (SM80, torch.bfloat16, 16, []), (SM80, torch.float16, 1, []),
    (SM90, FP8, 16, []), (SM90, torch.float16, 7, []),
    (SM100, torch.bfloat16, 32, []), (SM103, FP8, 64, []),
    (SM100, torch.bfloat16, 16, ["block size 16 not supported by flashinfer's trtllm-gen MLA "
                                 "kernel on SM100 (supported: 32, 64)"]),
    (SM80, FP8, 16, ["dtype torch.float8_e4m3fn not supported by flashinfer's fa2 MLA kernel "
                     "on SM80 with 16 heads (supported: ['torch.float16', "
                     "'torch.bfloat16'])"]),
    (SM75, torch.bfloat16, 16, ["compute capability 7.5 not supported"]),
    (None, torch.bfloat16, 16, ["device capability not available"]),
    (SM90, torch.float32, 16, ["dtype torch.float32 not supported"]),
])
def test_flashinfer_validate_configuration(monkeypatch: pytest.MonkeyPatch,
                                           cap: DeviceCapability | None, dtype: torch.dtype,
                                           bs: int, expected: list[str]) -> None:
    _available(monkeypatch, fi_mod, True)
    assert FlashInferMLADecodeBackend.validate_configuration(
        cap, cfg(dtype, block_size=bs)) == expected


def test_flashinfer_reasons_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, fi_mod, False)
    reasons = FlashInferMLADecodeBackend.validate_configuration(
        SM100, cfg(torch.float16, rank=256, rope=32, block_size=16))
    assert [r.split(" ")[0] for r in reasons] == ["dtype", "flashinfer-python", "MLA", "block"]
    assert "trtllm-gen" in reasons[0] and "pip install 'app[flashinfer]'" in reasons[1]
    _available(monkeypatch, fi_mod, True)
    # 96 heads: trtllm-gen refuses them, fa2 runs (any block size, no FP8)
    assert FlashInferMLADecodeBackend.validate_configuration(SM100, cfg(heads=96,
                                                                        block_size=16)) == []
    assert "fa2" in FlashInferMLADecodeBackend.validate_configuration(
        SM100, cfg(FP8, heads=96))[0]


def test_flashinfer_wrapper_refuses_causal_tiles_that_split_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, fi_mod, True)
    for heads, qlen, ok in ((16, 4, True), (16, 16, True), (128, 8, True), (24, 1, True),
                            (24, 2, False), (96, 4, False), (64, 2, True)):
        reasons = FlashInferMLADecodeBackend.validate_configuration(
            SM90, cfg(heads=heads, query_len=qlen, block_size=16))
        assert (reasons == []) is ok, (heads, qlen, reasons)
        assert fi_mod.causal_tiles_fit(heads, qlen) is ok
    # trtllm-gen has no such limit (Blackwell, 16 heads: no wrapper involved)
    assert FlashInferMLADecodeBackend.validate_configuration(SM100, cfg(heads=48,
                                                                        query_len=3)) == []


@pytest.mark.parametrize(("cap", "ok"), [(SM80, False), (SM90, False), (SM100, True),
                                         (SM103, True), (SM107, True),
                                         (DeviceCapability(10, 1), False), (SM110, False),
                                         (SM120, False)])
def test_tokenspeed_capabilities(monkeypatch: pytest.MonkeyPatch, cap: DeviceCapability,
                                 ok: bool) -> None:
    _available(monkeypatch, ts_mod, True)
    assert (TokenSpeedMLADecodeBackend.validate_configuration(cap, cfg()) == []) is ok


@pytest.mark.parametrize(("bs", "ok"), [(1, False), (2, True), (16, True), (48, False),
                                        (128, True), (256, False)])
def test_tokenspeed_block_sizes(monkeypatch: pytest.MonkeyPatch, bs: int, ok: bool) -> None:
    _available(monkeypatch, ts_mod, True)
    reasons = TokenSpeedMLADecodeBackend.validate_configuration(SM100, cfg(block_size=bs))
    assert reasons == ([] if ok else [
        f"block size {bs} not supported (supported: 2, 4, 8, 16, 32, 64, 128)"])


def test_tokenspeed_reasons_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, ts_mod, False)
    reasons = TokenSpeedMLADecodeBackend.validate_configuration(
        SM90, cfg(torch.float32, heads=256, rank=256, block_size=1))
    assert reasons[0] == "compute capability 9.0 not supported"
    assert reasons[1] == "dtype torch.float32 not supported"
    assert reasons[2] == "tokenspeed-mla is not installed (pip install 'app[tokenspeed]')"
    assert reasons[3].startswith("MLA dimensions")
    assert reasons[4] == "256 query heads not supported (at most 128)"
    assert reasons[5].startswith("block size 1 not supported")
    _available(monkeypatch, ts_mod, True)
    assert TokenSpeedMLADecodeBackend.validate_configuration(SM100, cfg(FP8, heads=128)) == []


def test_constructors_refuse_what_the_kernels_cannot_run() -> None:
    args = (16, 0.1, 512, 64)
    with pytest.raises(ValueError, match="device_capability is required"):
        FlashInferMLADecodeBackend(*args, torch.bfloat16)
    with pytest.raises(ValueError, match="fa2 MLA kernel"):
        FlashInferMLADecodeBackend(*args, FP8, device_capability=SM80)
    with pytest.raises(ValueError, match="trtllm-gen MLA decode reads cache blocks of"):
        FlashInferMLADecodeBackend(*args, torch.bfloat16, device_capability=SM100,
                                   block_size=16)
    with pytest.raises(ValueError, match=r"compute capability 7\.5"):
        FlashInferMLADecodeBackend(*args, torch.bfloat16, device_capability=SM75)
    with pytest.raises(ValueError, match="kv_lora_rank, qk_rope_head_dim"):
        FlashInferMLADecodeBackend(16, 0.1, 256, 64, torch.bfloat16, device_capability=SM90)
    with pytest.raises(TypeError, match="workspaces must have get"):
        FlashInferMLADecodeBackend(*args, torch.bfloat16, device_capability=SM100,
                                   workspaces=object())
    with pytest.raises(ValueError, match="at most 128 query heads"):
        TokenSpeedMLADecodeBackend(256, 0.1, 512, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute capability 9\.0"):
        TokenSpeedMLADecodeBackend(*args, torch.bfloat16, device_capability=SM90)
    with pytest.raises(TypeError, match="workspaces must have get"):
        TokenSpeedMLADecodeBackend(*args, torch.bfloat16, workspaces=42)
    for cls in (FlashInferMLADecodeBackend, TokenSpeedMLADecodeBackend):
        with pytest.raises(ValueError, match="scale"):
            cls(16, float("nan"), 512, 64, torch.bfloat16, device_capability=SM100)


# -- binding the exact arguments to the installed signatures ------------------------------

def _prepared(cls: type[MLADecodeBackend], cap: DeviceCapability, lens: list[int], bs: int,
              qlen: int, dtype: torch.dtype = torch.bfloat16
              ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    backend = support.on_cpu(cls, cap)(16, 0.1, 512, 64, dtype)
    cache, table, seq = support.paged_step(lens, bs)
    backend.prepare_metadata(table, seq, qlen)
    return backend, cache.to(dtype), table


@pytest.mark.parametrize(("cap", "dtype"), [(SM80, torch.float16), (SM90, torch.bfloat16),
                                            (SM90, FP8)])
def test_flashinfer_wrapper_arguments_bind(cap: DeviceCapability, dtype: torch.dtype) -> None:
    flashinfer_mla = pytest.importorskip("flashinfer.mla")
    wrapper = flashinfer_mla.BatchMLAPagedAttentionWrapper
    backend, cache, _ = _prepared(FlashInferMLADecodeBackend, cap, [5, 40, 17], 16, 2, dtype)
    kernels = FlashInferMLAKernels(wrapper, flashinfer_mla.MLAPlanMetadata, lambda: None)
    q_dtype = backend.query_dtypes()[0]
    plan = public.bind(wrapper.plan, None,
                       **backend.plan_kwargs(backend.metadata, 16, q_dtype, 0.1, kernels))
    md = plan["metadata"]
    assert isinstance(md, flashinfer_mla.MLAPlanMetadata)
    public.check_csr(md, 16)
    assert md.qo_indptr.tolist() == [0, 2, 4, 6] and md.kv_indptr.tolist() == [0, 1, 4, 6]
    assert md.kv_len_arr.tolist() == [5, 40, 17]
    assert plan["causal"] is True and plan["lse_mode"] == "basee"
    assert plan["scale_mode"] == ("kv-per-tensor" if dtype == FP8 else "default")
    init = public.bind(wrapper.__init__, None, torch.empty(0, dtype=torch.uint8),
                       backend=backend.kernel)
    assert init["backend"] == ("fa2" if cap == SM80 else "fa3")
    rows = 6
    run_kwargs = backend.run_kwargs(torch.zeros(rows, 16, 576, dtype=q_dtype), cache,
                                    torch.zeros(rows, 16, 512, dtype=q_dtype),
                                    torch.zeros(rows, 16), 0.5)
    run = public.bind(wrapper.run, None, **run_kwargs)
    public.check_run_agrees_with_plan(plan, run)
    if dtype == FP8:
        assert run["ckv_scale"] == run["kpe_scale"] == 0.5


def test_the_public_contract_checks_can_fail() -> None:
    """The checks above, written from flashinfer's documentation, refuse what it refuses."""
    flashinfer_mla = pytest.importorskip("flashinfer.mla")
    wrapper = flashinfer_mla.BatchMLAPagedAttentionWrapper
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="pages per request"):
        public.check_csr(flashinfer_mla.MLAPlanMetadata.csr(i32(0, 1), i32(0, 1), i32(3),
                                                            i32(17)), 16)
    plan = public.bind(wrapper.plan, None, lse_mode="basee", q_data_type=torch.bfloat16)
    run = public.bind(wrapper.run, None, return_lse=True)
    with pytest.raises(ValueError, match="lse_mode"):
        public.check_run_agrees_with_plan(plan, run)              # base 2 asked at run
    with pytest.raises(ValueError, match="kv-per-tensor"):
        public.check_run_agrees_with_plan(plan, {**run, "return_lse_base_on_e": True,
                                                 "ckv_scale": 0.5})
    with pytest.raises(ValueError, match="not one flashinfer takes"):
        public.check_run_agrees_with_plan({**plan, "lse_mode": "natural"}, run)


def test_trtllm_arguments_bind() -> None:
    decode = pytest.importorskip("flashinfer.decode")
    real = decode.trtllm_batch_decode_with_kv_cache_mla
    backend, cache, table = _prepared(FlashInferMLADecodeBackend, SM100, [5, 70, 33], 32, 4)
    q = torch.zeros(3, 4, 16, 576, dtype=torch.bfloat16)
    kwargs = backend.trtllm_kwargs(backend.metadata, q, cache, torch.zeros(3, 4, 16, 512),
                                   torch.zeros(3, 4, 16), 0.25, 1.5)
    bound = public.bind(real, **kwargs)
    assert bound["backend"] == "trtllm-gen" and bound["return_lse_base"] == "basee"
    assert "basee" in public.literal_choices(real, "return_lse_base")
    assert (bound["bmm1_scale"], bound["bmm2_scale"], bound["max_seq_len"]) == (0.25, 1.5, 70)
    assert bound["is_var_seq"] is True and bound["return_lse"] is True
    assert bound["block_tables"].dtype == bound["seq_lens"].dtype == torch.int32
    assert torch.equal(bound["block_tables"], table)
    ws = bound["workspace_buffer"]
    assert ws.dtype == torch.uint8 and not ws.any()
    assert ws.numel() == fi_mod.trtllm_gen_workspace_bytes(3, 4, 16, with_lse=True)
    public.check_trtllm_shapes(bound)                # the shapes the function documents
    with pytest.raises(ValueError, match="block_tables / max_seq_len"):
        public.check_trtllm_shapes({**bound, "max_seq_len": 200})


@pytest.mark.parametrize("cap", [SM80, SM90, SM100])
def test_flashinfer_dtypes_match_the_documented_kernels(cap: DeviceCapability) -> None:
    """The cache dtypes FLASHINFER_MLA accepts on a GPU, and the query dtype it hands the
    kernel for each, are the ones flashinfer documents for the kernel it picks there
    (``_flashinfer_contract.DOCUMENTED_DTYPES``)."""
    kernel = decode_kernel_for(cap, 16)
    documented = public.DOCUMENTED_DTYPES[kernel]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, FP8):
        ours = FlashInferMLADecodeBackend.validate_configuration(cap, cfg(dtype,
                                                                          block_size=32))
        assert (ours == []) is (dtype in documented), (cap, dtype, ours)
        if ours == []:
            backend = support.on_cpu(FlashInferMLADecodeBackend, cap)(16, 0.1, 512, 64, dtype)
            assert backend.kernel == kernel
            assert backend._kernel_q_dtype() == documented[dtype], (cap, dtype)


@pytest.mark.slow
def test_tokenspeed_declarations_match_the_package_can_implement() -> None:
    """Every block size / head count / query_len / dtype TOKENSPEED_MLA accepts is one the
    package's own ``_check_can_implement`` accepts, and the ones it refuses are refused."""
    pytest.importorskip("tokenspeed_mla")
    from tokenspeed_mla.mla_decode import _check_can_implement

    cls = TokenSpeedMLADecodeBackend
    for dtype in cls.supported_dtypes:
        for bs in (1, 2, 4, 8, 16, 32, 48, 64, 128, 256):
            for heads in (8, 16, 32, 64, 96, 128, 256):
                for qlen in (1, 2, 3, 4, 8, 16):
                    for var_seq in (True, False):
                        ours = cls.validate_configuration(SM100, cfg(
                            dtype, heads=heads, block_size=bs, query_len=qlen)) == []
                        try:
                            _check_can_implement(dtype, bs, heads, qlen, 512, 64, not var_seq,
                                                 var_seq, False, (10, 0))
                            theirs = True
                        except ValueError:
                            theirs = False
                        assert ours is theirs, (dtype, bs, heads, qlen, var_seq)


def test_tokenspeed_arguments_bind(fake_tokenspeed: list[dict[str, Any]]) -> None:
    tokenspeed = pytest.importorskip("tokenspeed_mla")  # the real one, not the stand-in
    backend, cache, _ = _prepared(TokenSpeedMLADecodeBackend, SM100, [9, 9], 16, 3)
    q = torch.zeros(2, 3, 16, 576, dtype=torch.bfloat16)
    kwargs = backend.decode_kwargs(backend.metadata, q, cache, torch.zeros(2, 3, 16, 512),
                                   torch.zeros(8, dtype=torch.int8), 0.1, 2.0)
    bound = inspect.signature(tokenspeed.tokenspeed_mla_decode).bind(**kwargs).arguments
    assert bound["is_var_seq"] is False  # every request has 9 tokens
    assert (bound["softmax_scale"], bound["output_scale"], bound["max_seq_len"]) == (0.1, 2.0,
                                                                                      9)
    assert bound["return_lse"] is True and bound["causal_mask"] is True
    assert list(inspect.signature(tokenspeed.get_num_sm).parameters) == ["device"]


def test_gpu_backends_refuse_cpu_tensors() -> None:
    for cls, cap in ((FlashInferMLADecodeBackend, SM90), (TokenSpeedMLADecodeBackend, SM100)):
        backend = cls(16, 0.1, 512, 64, torch.bfloat16, device_capability=cap)
        cache, table, seq = support.paged_step([3], 16)
        backend.prepare_metadata(table, seq, 1)
        with pytest.raises(ValueError, match="expected CUDA tensors"):
            backend.run_decode(torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16),
                                   cache.bfloat16())


# -- the whole plumbing on CPU, with stand-in kernels ---------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("cap", "dtype"), [(SM80, torch.float16), (SM90, torch.bfloat16)])
def test_flashinfer_wrapper_plumbing_conforms(fake_flashinfer: fakes.FakeFlashInferMLA,
                                              cap: DeviceCapability, dtype: torch.dtype
                                              ) -> None:
    assert_decode_conformance(support.on_cpu(FlashInferMLADecodeBackend, cap), dtype=dtype,
                              num_heads=8)
    assert {c["backend"] for c in fake_flashinfer.created} == {decode_kernel_for(cap, 8)}
    assert fake_flashinfer.runs and not fake_flashinfer.trtllm_calls
    assert all(r["return_lse_base_on_e"] for r in fake_flashinfer.runs)


@pytest.mark.slow
def test_flashinfer_trtllm_plumbing_conforms(fake_flashinfer: fakes.FakeFlashInferMLA) -> None:
    cls = support.on_cpu(FlashInferMLADecodeBackend, SM100)
    cases = [c for c in DECODE_CASES if c != "other_block_size"]  # it would try 5 tokens
    assert_decode_conformance(cls, dtype=torch.bfloat16, num_heads=8, block_size=32,
                              cases=cases)
    assert_decode_conformance(cls, dtype=torch.bfloat16, num_heads=8, block_size=64,
                              cases=["paged", "causal_query_len_4"])
    calls = fake_flashinfer.trtllm_calls
    assert calls and not fake_flashinfer.plans
    assert {c["return_lse_base"] for c in calls} == {"basee"}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tokenspeed_plumbing_conforms(fake_tokenspeed: list[dict[str, Any]],
                                      dtype: torch.dtype) -> None:
    assert_decode_conformance(support.on_cpu(TokenSpeedMLADecodeBackend, SM100), dtype=dtype,
                              num_heads=8)
    assert fake_tokenspeed and all(c["return_lse"] for c in fake_tokenspeed)
    assert {c["is_var_seq"] for c in fake_tokenspeed} == {True, False}


@pytest.mark.slow
def test_fa3_nonfinite_rows_reproduce_the_h100_and_the_declaration_passes_the_kit(
        fake_flashinfer: fakes.FakeFlashInferMLA) -> None:
    """The stand-in does what the fa3 kernel's source does with a masked key's value (the
    H100 run: a NaN in the last new token made all 4 rows of the request non-finite). Held
    to isolation, FLASHINFER_MLA fails ``nonfinite_keys`` as on the H100; with its
    declaration (``isolates_nonfinite_keys = False``) the kit holds it to what it promises."""
    assert FlashInferMLADecodeBackend.isolates_nonfinite_keys is False
    cls = support.on_cpu(FlashInferMLADecodeBackend, SM90)
    assert_decode_conformance(cls, dtype=torch.bfloat16, num_heads=8,
                              cases=["nonfinite_keys"])
    claimed = type("Isolating", (cls,), {"isolates_nonfinite_keys": True})
    report = run_decode_conformance(claimed, dtype=torch.bfloat16, num_heads=8,
                                    cases=["nonfinite_keys"])
    assert not report.passed
    assert "must make exactly its last query row non-finite" in report.format()


def test_a_non_isolating_backend_must_still_poison_the_rows_that_see_the_key(
        fake_flashinfer: fakes.FakeFlashInferMLA, monkeypatch: pytest.MonkeyPatch) -> None:
    """``isolates_nonfinite_keys = False`` allows more non-finite rows, never fewer: a kernel
    that leaves the poisoned row finite (dropping the key) fails, as does one whose rows of
    another request turn non-finite."""
    cls = support.on_cpu(FlashInferMLADecodeBackend, SM90)
    fake_flashinfer.tile_wide_nonfinite_values = False
    real = fakes._paged_reference

    def drops_nonfinite_keys(q, kv, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real(q, torch.nan_to_num(kv.float(), nan=0.0), *args, **kwargs)

    monkeypatch.setattr(fakes, "_paged_reference", drops_nonfinite_keys)
    report = run_decode_conformance(cls, dtype=torch.bfloat16, num_heads=8,
                                    cases=["nonfinite_keys"])
    assert not report.passed and "must make its last query row non-finite" in report.format()

    def poisons_everything(q, kv, *args, **kwargs):  # type: ignore[no-untyped-def]
        out, lse = real(q, kv, *args, **kwargs)
        if not bool(torch.isfinite(kv.float()[..., :512]).all()):
            out[:] = float("nan")
        return out, lse

    monkeypatch.setattr(fakes, "_paged_reference", poisons_everything)
    report = run_decode_conformance(cls, dtype=torch.bfloat16, num_heads=8,
                                    cases=["nonfinite_keys"])
    assert not report.passed and "no row of another request" in report.format()


def test_a_base2_lse_left_unconverted_fails_the_kit(fake_tokenspeed: list[dict[str, Any]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ts_mod, "base2_to_natural", lambda src, dst: dst.copy_(src))
    report = run_decode_conformance(support.on_cpu(TokenSpeedMLADecodeBackend, SM100),
                                    dtype=torch.bfloat16, num_heads=8, cases=["paged"])
    assert not report.passed and report.cases[0].lse_error is not None
    assert report.cases[0].lse_error > 1.0


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert float((got.double() - ref).abs().max()) <= tol


def test_flashinfer_plans_once_per_step(fake_flashinfer: fakes.FakeFlashInferMLA) -> None:
    lens = [5, 40, 17]
    backend, cache, table = _prepared(FlashInferMLADecodeBackend, SM90, lens, 16, 2)
    q, cache = support.bf16_query(3, 2), cache.bfloat16()
    for _ in range(4):  # four layers of one step
        backend.run_decode(q, cache)
    assert (len(fake_flashinfer.created), len(fake_flashinfer.plans),
            len(fake_flashinfer.runs)) == (1, 1, 4)
    out = backend.run_decode(q, cache, softmax_scale=0.05)   # another scale: re-plan
    backend.run_decode(q, cache, softmax_scale=0.05)
    assert len(fake_flashinfer.plans) == 2 and fake_flashinfer.plans[-1]["sm_scale"] == 0.05
    _close(out, reference_decode(q, cache, table, lens, 512, 0.05)[0], 2e-2)
    out, lse = backend.run_decode(q, cache, k_scale=2.0, return_softmax_lse=True)
    ref_out, ref_lse = reference_decode(q, cache, table, lens, 512, 0.1, 2.0)
    _close(out, ref_out, 5e-2)
    _close(lse, ref_lse, 2e-2)
    assert fake_flashinfer.plans[-1]["sm_scale"] == pytest.approx(0.2)  # k_scale folded in
    backend.run_decode(q, cache)
    assert fake_flashinfer.plans[-1]["sm_scale"] == 0.1                 # nothing kept
    cache2, table2, seq2 = support.paged_step([3, 3], 16)
    backend.prepare_metadata(table2, seq2, 1)                           # a new step
    backend.run_decode(support.bf16_query(2, 1), cache2.bfloat16())
    assert len(fake_flashinfer.plans) == 5 and len(fake_flashinfer.created) == 1
    assert fake_flashinfer.plans[-1]["causal"] is False                 # one row per request


def test_flashinfer_plans_in_prepare_metadata_when_the_block_size_is_known(
        fake_flashinfer: fakes.FakeFlashInferMLA) -> None:
    from app.config import EngineConfig

    config = EngineConfig.from_dict({"cache": {"block_size": 32}})
    backend = support.on_cpu(FlashInferMLADecodeBackend, SM90).from_config(config, SM90)
    assert isinstance(backend, FlashInferMLADecodeBackend) and backend.block_size == 32
    lens = [5, 70]
    cache, table, seq = support.paged_step(lens, 32)
    backend.prepare_metadata(table, seq, 1)
    assert len(fake_flashinfer.plans) == 1 and not fake_flashinfer.runs  # planned already
    assert fake_flashinfer.plans[0]["page_size"] == 32
    q = support.bf16_query(2, 1)
    out = backend.run_decode(q, cache.bfloat16())
    assert len(fake_flashinfer.plans) == 1                              # reused by the layer
    _close(out, reference_decode(q, cache.bfloat16(), table, lens, 512, config.model.scale)[0],
           2e-2)


def test_flashinfer_threads_with_different_scales_never_share_a_plan(
        fake_flashinfer: fakes.FakeFlashInferMLA, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    real_run = fake_flashinfer.wrapper_cls.run

    def slow_run(self: Any, **kwargs: Any) -> Any:
        time.sleep(0.002)  # a launch takes time: let another thread in between plan and run
        return real_run(self, **kwargs)

    monkeypatch.setattr(fake_flashinfer.wrapper_cls, "run", slow_run)
    lens = [5, 20]
    backend, cache, table = _prepared(FlashInferMLADecodeBackend, SM90, lens, 16, 1)
    q, cache = support.bf16_query(2, 1), cache.bfloat16()
    scales = (0.02, 0.05, 0.1, 0.2)
    refs = {s: reference_decode(q, cache, table, lens, 512, s)[0] for s in scales}
    errors: list[float] = []

    def layer_calls(scale: float) -> None:
        for _ in range(5):
            out = backend.run_decode(q, cache, softmax_scale=scale)
            errors.append(float((out.double() - refs[scale]).abs().max()))

    threads = [threading.Thread(target=layer_calls, args=(s,)) for s in scales]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 20 and max(errors) <= 2e-2


def test_tokenspeed_scales_are_read_on_every_call(fake_tokenspeed: list[dict[str, Any]]
                                                  ) -> None:
    lens = [7, 30]
    backend, cache, table = _prepared(TokenSpeedMLADecodeBackend, SM100, lens, 16, 1)
    q = support.bf16_query(2, 1)
    backend.run_decode(q, cache)                                     # profiling defaults
    out = backend.run_decode(q, cache, softmax_scale=0.03, k_scale=0.5)
    last = fake_tokenspeed[-1]
    assert last["softmax_scale"] == pytest.approx(0.015) and last["output_scale"] == 0.5
    _close(out, reference_decode(q, cache, table, lens, 512, 0.03, 0.5)[0], 2e-2)
    backend.run_decode(q, cache)
    assert (fake_tokenspeed[-1]["softmax_scale"], fake_tokenspeed[-1]["output_scale"]) == (
        0.1, 1.0)


def _fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, float]:
    k_scale = float(cache.abs().max()) / 448.0
    return (cache / k_scale).to(FP8), k_scale


@pytest.mark.parametrize("kernel", ["tokenspeed", "trtllm-gen", "fa3"])
def test_fp8_cache_takes_its_scales_per_call(request: pytest.FixtureRequest,
                                             kernel: str) -> None:
    from app.backends.decode._gpu import quantize_query_fp8

    if kernel == "tokenspeed":
        calls = request.getfixturevalue("fake_tokenspeed")
        cls, cap, bs = TokenSpeedMLADecodeBackend, SM100, 16
    else:
        fake = request.getfixturevalue("fake_flashinfer")
        calls = fake.trtllm_calls if kernel == "trtllm-gen" else fake.runs
        cls, cap, bs = FlashInferMLADecodeBackend, (SM100 if kernel == "trtllm-gen" else SM90), 32
    lens = [9, 70, 33]
    backend = support.on_cpu(cls, cap)(16, 0.1, 512, 64, FP8)
    cache, table, seq = support.paged_step(lens, bs)
    cache8, k_scale = _fp8_cache(cache)
    backend.prepare_metadata(table, seq, 2)
    q = support.bf16_query(3, 2, seed=1)
    q8, q_scale = quantize_query_fp8(q)
    q_seen = q if kernel == "fa3" else (q8.float() * q_scale)
    for scale in (k_scale, 2 * k_scale):  # a changed scale is used at once
        out, lse = backend.run_decode(q, cache8, k_scale=scale, return_softmax_lse=True)
        ref_out, ref_lse = reference_decode(q_seen, cache8, table, lens, 512, 0.1, scale)
        _close(out, ref_out, 3e-2 * max(1.0, 2 * scale / k_scale))
        _close(lse, ref_lse, 1e-3)
        # against the unquantised query: only the FP8 rounding of q (3 mantissa bits)
        loose_out = reference_decode(q, cache8, table, lens, 512, 0.1, scale)[0]
        assert float((out.double() - loose_out).abs().mean()) < 0.1
        call = calls[-1]
        if kernel == "fa3":
            assert call["ckv_scale"] == call["kpe_scale"] == scale
            assert call["query"].dtype == torch.bfloat16
        else:
            assert call["query"].dtype == FP8
            key1, key2 = ("softmax_scale", "output_scale") if kernel == "tokenspeed" else (
                "bmm1_scale", "bmm2_scale")
            assert float(call[key1]) == pytest.approx(0.1 * scale * float(q_scale))
            assert float(call[key2]) == pytest.approx(scale)
            # trtllm-gen takes the query's scale as a device tensor (no host sync); tokenspeed
            # takes host floats
            assert isinstance(call[key1], torch.Tensor) is (kernel == "trtllm-gen")
    assert out.dtype == torch.bfloat16


def test_fp8_query_quantisation_keeps_non_finite_values_to_their_row() -> None:
    from app.backends.decode._gpu import quantize_query_fp8

    q = torch.randn(2, 3, 4, 8)
    q[1, 2, 0, 5] = float("nan")
    q[0, 1, 3, 2] = float("inf")
    q8, scale = quantize_query_fp8(q)
    assert q8.dtype == FP8 and scale.shape == (1,) and scale.dtype == torch.float32
    finite = q.abs().masked_fill(~torch.isfinite(q), 0).amax() / 448
    assert float(scale) == pytest.approx(float(finite))
    back = q8.float() * scale
    bad = ~torch.isfinite(back)
    assert bad[1, 2, 0, 5] and bad[0, 1, 3, 2] and int(bad.sum()) == 2
    ok = torch.isfinite(q)
    assert float((back[ok] - q[ok]).abs().max()) <= float(finite) * 448 / 16
    zero8, one = quantize_query_fp8(torch.zeros(1, 1, 1, 4))
    assert float(one) == 1.0 and not zero8.float().any()


def test_bad_inputs_fail_before_any_kernel(fake_flashinfer: fakes.FakeFlashInferMLA,
                                           fake_tokenspeed: list[dict[str, Any]]) -> None:
    for cls, cap in ((FlashInferMLADecodeBackend, SM90), (FlashInferMLADecodeBackend, SM100),
                     (TokenSpeedMLADecodeBackend, SM100)):
        backend = support.on_cpu(cls, cap)(16, 0.1, 512, 64, torch.bfloat16)
        cache, table, seq = support.paged_step([40, 70], 32)
        with pytest.raises(ValueError, match="uniform query_len"):
            backend.prepare_metadata(table, seq, [1, 2])
        backend.prepare_metadata(table[:, :2], seq, 1)           # 70 tokens need 3 blocks
        with pytest.raises(ValueError, match="needs 3 blocks"):
            backend.run_decode(support.bf16_query(2, 1), cache.bfloat16())
        backend.prepare_metadata(table, seq, 1)
        with pytest.raises(ValueError, match="query dtype"):
            backend.run_decode(support.bf16_query(2, 1).float(), cache.bfloat16())
        with pytest.raises(ValueError, match="kv_cache must be"):
            backend.run_decode(support.bf16_query(2, 1), cache[..., :512].bfloat16())
        with pytest.raises(ValueError, match="k_scale"):
            backend.run_decode(support.bf16_query(2, 1), cache.bfloat16(), k_scale=0.0)
    assert not (fake_flashinfer.plans or fake_flashinfer.runs or fake_flashinfer.trtllm_calls
                or fake_tokenspeed)
