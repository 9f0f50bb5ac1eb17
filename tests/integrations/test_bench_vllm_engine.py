"""``python -m app bench vllm-engine``: its arguments, its error report, its figures, and (where
vLLM is installed) a quick run whose two sides really are vLLM's own backends and ours."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from app.bench import vllm_engine
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


def _run(seconds: dict[str, float]) -> dict[str, Any]:
    return {"init_s": 1.0, "jobs": [{"name": k, "seconds": [v, v * 2]}
                                    for k, v in seconds.items()]}


def test_the_figures_are_best_of_all_runs_and_the_decode_phase_is_timed_apart() -> None:
    load = vllm_engine.workloads(False, 64)
    runs = [_run({"prefill-heavy": 2.0, "decode-heavy prefill": 1.0, "decode-heavy": 5.0}),
            _run({"prefill-heavy": 4.0, "decode-heavy prefill": 0.5, "decode-heavy": 9.0})]
    figures = vllm_engine._side_figures(runs, load)
    assert figures["best_seconds"] == {"prefill-heavy": 2.0, "decode-heavy prefill": 0.5,
                                       "decode-heavy": 5.0}
    assert figures["prefill_heavy_tokens_per_s"] == round(10240 / 2.0, 1)
    assert figures["decode_heavy_tokens_per_s"] == round(8 * 63 / 4.5, 2)
    assert figures["decode_heavy_whole_tokens_per_s"] == round(8 * 64 / 5.0, 2)


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
    assert [t["target"] for t in result["targets"]] == [3.0, 1.5]
