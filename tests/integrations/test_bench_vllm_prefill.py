"""``python -m app bench vllm-prefill``: its arguments, its error report, and (where vLLM is
installed) its worker timing vLLM's CPU backend and ours through vLLM's interface."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from app.bench.vllm import prefill as vllm_prefill
from app.cli import main


def test_needs_a_vllm_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_prefill.VLLM_PYTHON_ENV, raising=False)
    assert main(["bench", "vllm-prefill", "--quick"]) == 2
    assert main(["bench", "vllm-prefill", "--quick", "--vllm-python", sys.executable,
                 "--dtypes", "int8"]) == 2


def test_a_missing_vllm_python_is_reported(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-python")
    assert main(["bench", "--json", "vllm-prefill", "--quick", "--vllm-python", missing]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and missing in result["error"]
    assert result["cpu"] and result["results"] == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed here (the worker runs in the vLLM environment)")
def test_worker_times_both_classes_through_vllms_interface(fresh_vllm: None) -> None:
    out = vllm_prefill._worker({"dtypes": ["fp32", "bf16"], "heads": 2, "repeat": 1,
                                "cases": vllm_prefill.default_cases(quick=True)[:2]})
    assert out["vllm_version"] == "0.32.0"
    assert out["selected_by_vllm"] == "app.integrations.vllm.AppCPUMLAPrefillBackend"
    assert len(out["results"]) == 4
    for row in out["results"]:
        assert row["vllm_ms"] > 0 and row["ours_ms"] > 0 and row["speedup"] > 0
        assert row["max_abs_diff_out"] < (2e-2 if row["dtype"] == "bfloat16" else 1e-4)
        assert row["max_abs_diff_lse"] < 1e-3
