"""``python -m app bench vllm-engine``: its arguments, its error report, its figures, and (where
vLLM is installed) a quick run whose two sides really are vLLM's own backends and ours."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from app.bench.vllm import engine as vllm_engine
from app.cli import main


def test_needs_a_vllm_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APP_BENCH_VLLM_PYTHON", raising=False)
    assert main(["bench", "vllm-engine", "--quick"]) == 2
    assert main(["bench", "vllm-engine", "--quick", "--vllm-python", sys.executable,
                 "--layers", "0"]) == 2
    assert main(["bench", "vllm-engine", "--quick", "--vllm-python", sys.executable,
                 "--dtype", "int8"]) == 2


def test_a_missing_vllm_python_is_reported(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-python")
    assert main(["bench", "--json", "vllm-engine", "--quick", "--vllm-python", missing]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and missing in result["error"]
    assert result["cpu"] and result["targets"] == []


def _run(prefill: float, whole: float, first: list[float | None], tokens: list[int]
         ) -> dict[str, Any]:
    return {"init_s": 1.0, "jobs": [
        {"name": "prefill-heavy", "seconds": [prefill, prefill * 2]},
        {"name": "decode-heavy", "seconds": [whole, whole * 2], "first_token_seconds": first,
         "decode_tokens": tokens}]}


def test_the_figures_are_best_of_all_runs_and_the_decode_phase_is_timed_inside_the_run() -> None:
    load = vllm_engine.workloads(False, 64)
    assert [job.get("timeline", False) for job in vllm_engine._jobs(load, 100, 1)] == [
        False, True]
    runs = [_run(2.0, 5.0, [1.0, 2.5], [504, 504]), _run(4.0, 9.0, [7.0, None], [480, 0])]
    figures = vllm_engine._side_figures(runs, load)
    assert figures["best_seconds"] == {"prefill-heavy": 2.0, "decode-heavy": 5.0}
    assert figures["prefill_heavy_tokens_per_s"] == round(10240 / 2.0, 1)
    # the best decode phase of every run that had one: 480 tokens in 9 - 7 = 2 s
    assert figures["decode_heavy_tokens_per_s"] == 240.0
    assert figures["decode_phase_runs"] == [{"seconds": 4.0, "tokens": 504},
                                            {"seconds": 7.5, "tokens": 504},
                                            {"seconds": 2.0, "tokens": 480}]
    assert figures["decode_heavy_whole_tokens_per_s"] == round(8 * 64 / 5.0, 2)


def test_a_decode_rate_is_never_null_for_a_run_that_decoded() -> None:
    """Issue 38: on an AMX machine the one-token run took longer than the whole one and the
    difference of the two runs gave null; a phase timed inside the run cannot."""
    load = vllm_engine.workloads(True, 4)
    figures = vllm_engine._side_figures([_run(1.0, 3.0, [2.9], [9])], load)
    assert figures["decode_heavy_tokens_per_s"] == round(9 / 0.1, 2)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed here (the bench runs in the vLLM environment)")
def test_a_quick_run_compares_vllms_own_backends_with_ours(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json", "vllm-engine", "--quick", "--vllm-python",
                 sys.executable]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"], result.get("error")
    vllm_side, ours = result["sides"]["vllm"], result["sides"]["ours"]
    assert vllm_side["impl_classes"] == ["vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl"]
    assert ours["impl_classes"] == ["app.integrations.vllm_decode.AppCPUMLAImpl"]
    assert ours["prefill_classes"] == ["app.integrations.vllm.AppCPUMLAPrefillBackend"]
    for side in (vllm_side, ours):
        assert side["prefill_heavy_tokens_per_s"] > 0
        assert side["decode_heavy_whole_tokens_per_s"] > 0
        assert side["decode_heavy_tokens_per_s"] > 0 and side["decode_phase_runs"]
        assert all(run["tokens"] > 0 for run in side["decode_phase_runs"])
    assert [t["target"] for t in result["targets"]] == [3.0, 1.5]
