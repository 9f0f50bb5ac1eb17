"""``python -m app bench prefill --quick``: the JSON it prints and its baseline's correctness."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.bench import prefill
from app.cli import main
from app.testing import reference_attention

#: runs the prefill benchmark: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow


def test_quick_benchmark_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--json", "prefill", "--quick", "--dtypes", "fp32"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"] is True and result["errors"] == []
    assert result["device"] == "cpu"   # pinned by tests/conftest.py, on a GPU machine too
    assert result["matmul_fp32_gflops"] > 0
    rows = [r for r in result["results"] if r["backend"] == "TORCH_SDPA"]
    assert {r["case"] for r in rows} == {c.name for c in prefill.default_cases(quick=True)}
    for row in rows:
        assert row["ms"] > 0 and row["gflops"] > 0 and row["baseline_ms"] > 0
        # rel: both figures are rounded to 0.1 GFLOP/s (a slow matmul on a busy machine
        # makes the ratio large and an absolute bound too tight)
        assert row["ratio_to_matmul"] == pytest.approx(
            row["gflops"] / result["matmul_fp32_gflops"], rel=1e-2, abs=2e-3)
        assert row["ratio_to_matmul_paired"] > 0
    assert result["targets"] == []  # the targets are on the full-size cases only
    peaks = result["peaks"]
    if result["device"] != "cpu" or peaks["kinds"].get("fp32_fma") != "measured":
        # a CPU the probe cannot run on (no AVX-512) says why, and no row claims a peak
        assert all(why for why in peaks["kinds"].values()) and "fp32_fma_gflops" not in peaks
        assert all(row.get("fraction_of_peak") is None for row in rows)
        return
    assert peaks["fp32_fma_gflops"] > 0 and result["target_measure"].startswith("fraction_of")
    for row in rows:  # float32 math: the fp32 FMA peak bounds every fp32 row
        assert row["bound_peak"] == "fp32_fma"
        assert row["peak_gflops"] == peaks["fp32_fma_gflops"]
        assert row["fraction_of_peak"] == pytest.approx(
            row["gflops"] / peaks["fp32_fma_gflops"], rel=5e-3, abs=2e-3)
        assert row["fraction_of_peak_paired"] > 0


def test_readable_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "prefill", "--quick", "--dtypes", "bf16", "--no-baseline",
                 "--backends", "TORCH_SDPA"]) == 0
    text = capsys.readouterr().out
    assert "TORCH_SDPA" in text and "GFLOP/s" in text


def test_bad_arguments() -> None:
    assert main(["bench", "prefill", "--quick", "--dtypes", "int8"]) == 2
    assert main(["bench", "prefill", "--quick", "--backends", "NOPE"]) == 2


def test_flop_count_and_targets() -> None:
    case = prefill.Case("1x4096", (4096,))
    dims = prefill._DIMS
    assert case.flops(16, dims) == 2 * 320 * 16 * 4096 * 4096 / 2
    ctx = prefill.Case("ctx", (512,), (2048,))
    assert ctx.flops(16, dims) == 2 * 320 * 16 * 512 * 2048
    rows = [{"backend": "TORCH_SDPA", "case": "4x512", "dtype": "float32",
             "speedup_vs_baseline": 2.5, "speedup_vs_vllm_algorithm": 3.2,
             "ratio_to_matmul": 0.3},
            {"backend": "TORCH_SDPA", "case": "1x4096", "dtype": "float32",
             "ratio_to_matmul": 0.8, "ratio_to_matmul_paired": 0.6}]
    targets = prefill._targets(rows)  # no peak measured: the matmul rate stands in
    assert [t["pass"] for t in targets] == [True, False]
    assert targets[0]["value"] == 3.2 and targets[0]["vs_strict_dense_baseline"] == 2.5
    assert targets[1]["value"] == 0.6 and targets[1]["best_vs_best_of_run"] == 0.8
    assert "matmul" in targets[1]["name"]


def test_peak_targets_read_the_bounding_peak() -> None:
    rows = [{"backend": "TORCH_SDPA", "case": "1x4096", "dtype": "float32",
             "ratio_to_matmul": 1.4, "ratio_to_matmul_paired": 1.5, "bound_peak": "fp32_fma",
             "fraction_of_peak": 0.74, "fraction_of_peak_paired": 0.76},
            {"backend": "TORCH_SDPA", "case": "1x4096", "dtype": "bfloat16",
             "ratio_to_matmul": 2.0, "ratio_to_matmul_paired": 2.0, "bound_peak": "bf16_dot",
             "fraction_of_peak": 0.61, "fraction_of_peak_paired": 0.59}]
    targets = prefill._targets(rows)
    assert [(t["target"], t["value"], t["pass"]) for t in targets] == [
        (0.75, 0.76, True), (0.6, 0.59, False)]
    assert "fp32_fma peak" in targets[0]["name"] and "bf16_dot peak" in targets[1]["name"]
    assert targets[0]["ratio_to_matmul_paired"] == 1.5  # kept beside the target


@pytest.mark.parametrize("causal", [True, False])
def test_dense_baseline_is_correct(causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    cu = [0, 5, 17]
    q = torch.randn(17, 4, 192, generator=gen)
    k = torch.randn(17, 4, 192, generator=gen)
    v = torch.randn(17, 4, 128, generator=gen)
    out, lse = prefill.dense_baseline(q, k, v, cu, cu, causal, 1 / math.sqrt(192))
    ref_out, ref_lse = reference_attention(q, k, v, cu, cu, causal, 1 / math.sqrt(192))
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_vllm_algorithm_baseline_matches_the_strict_baseline() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(12, 4, 24), torch.randn(12, 4, 24)
    v = torch.randn(12, 4, 16)
    cu = [0, 5, 12]
    out_a, lse_a = prefill.vllm_algorithm_baseline(q, k, v, cu, cu, True, 0.2)
    out_b, lse_b = prefill.dense_baseline(q, k, v, cu, cu, True, 0.2)
    torch.testing.assert_close(out_a, out_b.to(out_a.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_a, lse_b, rtol=1e-5, atol=1e-5)


def test_a_registered_third_party_backend_can_be_benchmarked() -> None:
    from app.backends import register_mla_prefill_backend
    from app.backends.prefill.torch_sdpa import TorchSDPABackend
    from app.containers import use_container

    class ThirdParty(TorchSDPABackend):
        @staticmethod
        def get_name() -> str:
            return "THIRD_PARTY_BENCH"

    container = prefill._bench_container(torch.device("cpu"), torch.float32, 2)
    with use_container(container):
        register_mla_prefill_backend("THIRD_PARTY_BENCH", ThirdParty)
    builders, skipped = prefill._backend_classes("third_party_bench", container)
    assert skipped == {} and len(builders) == 1
    backend = builders[0]()
    assert isinstance(backend, ThirdParty)
    assert backend.workspaces is container.kernel_workspaces()
    builders, _ = prefill._backend_classes("valid", container)
    assert any(isinstance(build(), ThirdParty) for build in builders)


def _small_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    real = prefill._inputs
    monkeypatch.setattr(prefill, "_inputs", lambda case, *args: real(
        prefill.Case("1x64", (64,)), *args))


def test_paired_costs_times_each_pair_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: the wrapper overhead (call vs bare launch) and the LSE's cost (call with vs
    without it) are each timed as a pair with nothing between their calls; the JSON says the
    ratio and whether it meets its target (3%, 10%)."""
    _small_inputs(monkeypatch)
    rounds: list[list[str]] = []
    fake_seconds = {"call": 1.05e-3, "launch": 1.0e-3, "lse": 1.2e-3, "no_lse": 1.0e-3}

    def fake_interleaved(fns: dict[str, object], *, repeat: int,
                         sync: object = None) -> dict[str, list[float]]:
        rounds.append(list(fns))
        for fn in fns.values():
            fn()  # type: ignore[operator]
        return {name: [fake_seconds[name]] * repeat for name in fns}

    monkeypatch.setattr(prefill, "time_interleaved", fake_interleaved)
    builders, _ = prefill._backend_classes(
        "TORCH_SDPA", prefill._bench_container(torch.device("cpu"), torch.float32, 2))
    wrapper, lse = prefill.paired_costs(builders[0], torch.float32, torch.device("cpu"), 2, 3)
    assert rounds == [["call", "launch"], ["lse", "no_lse"]]
    assert wrapper == {"backend": "TORCH_SDPA", "dtype": "float32", "call_ms": 1.05,
                       "launch_ms": 1.0, "overhead": 0.05, "target": 0.03, "pass": False}
    assert lse == {"backend": "TORCH_SDPA", "dtype": "float32", "lse_ms": 1.2,
                   "no_lse_ms": 1.0, "cost": 0.2, "target": 0.1, "pass": False}


def test_on_a_gpu_the_baselines_are_timed_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the dense baselines run in a loop of their own, after the backend's rounds: the
    H100's LSE rows, interleaved with them, looked twice as slow as the no-LSE rows. On the
    CPU they stay interleaved (a shared machine's slow spells hit both alike)."""
    rounds: list[list[str]] = []

    def fake_interleaved(fns: dict[str, object], *, repeat: int,
                         sync: object = None) -> dict[str, list[float]]:
        rounds.append(sorted(fns))
        for _ in range(repeat):
            for fn in fns.values():
                fn()  # type: ignore[operator]
        return {name: [1e-3] * repeat for name in fns}

    monkeypatch.setattr(prefill, "time_interleaved", fake_interleaved)
    monkeypatch.setattr(prefill, "time_calls", lambda *a, **k: {"min_s": 1e-3})
    monkeypatch.setattr(prefill, "_sync", lambda device: None)
    monkeypatch.setattr(prefill, "matmul_call", lambda device, n: (lambda: None))
    case = prefill.Case("1x64", (64,))
    builders, _ = prefill._backend_classes(
        "TORCH_SDPA", prefill._bench_container(torch.device("cpu"), torch.float32, 2))
    for device_type in ("cpu", "cuda"):
        rounds.clear()
        real_inputs = prefill._inputs

        def inputs(c: prefill.Case, heads: int, dtype: torch.dtype, device: torch.device,
                   real: object = real_inputs) -> object:
            return real(c, heads, dtype, torch.device("cpu"))  # type: ignore[operator]

        monkeypatch.setattr(prefill, "_inputs", inputs)
        fake_device = type("D", (), {"type": device_type})()
        prefill._run_case(builders[0], case, torch.float32, fake_device, 2, 2, True, 64)
        if device_type == "cpu":
            assert rounds == [["backend", "baseline", "matmul", "vllm_algorithm"]]
        else:
            assert rounds == [["backend", "matmul"], ["baseline", "vllm_algorithm"]]
