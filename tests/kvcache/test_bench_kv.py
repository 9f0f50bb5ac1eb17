"""The kv benchmark runs (tiny workload); vLLM is optional and its absence is reported."""

from __future__ import annotations

import argparse
import json

import pytest

from app.bench import kv
from app.cli import main

#: runs the KV benchmark: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow


def args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kv.add_arguments(parser)
    namespace = parser.parse_args([])
    namespace.vllm_python = None
    for key, value in overrides.items():
        setattr(namespace, key, value)
    return namespace


def test_tiny_benchmark_result_shape() -> None:
    result = kv.run(args(requests=4, tokens=256, sliding_window=64, repeat=1, hit_calls=3,
                         lookups=400))
    assert result["ok"]
    for kind in ("full_attention", "sliding_window"):
        ours = result["ours"][kind]
        assert ours["blocks"] == 64 and ours["hit_tokens"] == 256
        assert all(ours[f"{p}_s"] > 0 for p in kv.PHASES)
    assert result["ours"]["registry"]["bindings_lookups_per_s"] > 0
    text = kv.render(result)
    assert "full_attention" in text and "--vllm-python" in text


def test_missing_vllm_interpreter_is_reported(tmp_path: object) -> None:
    result = kv.run(args(requests=2, tokens=64, sliding_window=32, repeat=1, hit_calls=1,
                         lookups=40, vllm_python="/nonexistent/python"))
    assert "error" in result["vllm"] and "speedup_vs_vllm" not in result
    assert "vLLM side failed" in kv.render(result)


def test_cli_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json", "kv", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["requests"] == 16


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        kv.run(args(requests=0))
