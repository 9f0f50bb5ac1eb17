"""The selection benchmark runs (tiny loops), and the round-by-round timing helper it shares with
``bench kv`` serves loops from another interpreter (here: this one, standing in for vLLM's)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from app.bench import selection
from app.bench._timing import InterpreterLoops


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    selection.add_arguments(parser)
    namespace = parser.parse_args(["--number", "200", "--repeat", "2"])
    for key, value in overrides.items():
        setattr(namespace, key, value)
    return namespace


def test_tiny_selection_benchmark_result_shape() -> None:
    result = selection.run(_args())
    assert result["chosen"] == "TORCH_SDPA" and result["validated_classes"] == 5
    assert result["cached"]["repeat"] == 2 and result["uncached"]["median_us"] > 0
    assert set(result["informational"]) == {"uncached_like_vllm", "cached_explicit_backend",
                                            "cached_via_container_provider"}
    assert "vllm" not in result and "cached" in selection.render(result)


def test_a_missing_vllm_interpreter_is_reported(tmp_path: Path) -> None:
    result = selection.run(_args(vllm_python=tmp_path / "nope" / "python"))
    assert "does not exist" in result["vllm"]["error"]
    assert "vLLM:" in selection.render(result)


def test_interpreter_loops_time_on_command() -> None:
    script = "calls = []\nLOOPS = {'tick': lambda: calls.append(1)}\nINFO = {'who': 'me'}\n"
    with InterpreterLoops(sys.executable, script) as loops:
        assert loops.info == {"who": "me"}
        assert loops.seconds("tick", 1000) > 0
        assert loops.seconds("tick", 10, gc_off=True) >= 0
        with pytest.raises(RuntimeError, match="failed on 'nope'"):
            loops.seconds("nope", 1)


def test_interpreter_loops_that_cannot_start_say_why() -> None:
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        InterpreterLoops(sys.executable, "1 / 0\n")
