"""``python -m app bench model --baseline vllm``: our engine against a whole vLLM CPU engine
with its own backends, on a tiny DeepSeek-V3 checkpoint at production attention dims (runs
where vLLM is installed; the runner and its line protocol are tested everywhere with a
stand-in, ``tests/bench/test_bench_model.py``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from app.cli import main


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed here (the baseline runs in the vLLM "
                           "environment)")
def test_bench_model_against_vllms_own_engine(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec, write_deepseek_checkpoint

    # 16 new tokens, best of 2; each side's decode phase is timed inside its 16-token run
    # (issue 38: it was the difference of two runs, non-positive when a tiny run was noisy).
    checkpoint = write_deepseek_checkpoint(tmp_path / "v3", DeepseekCheckpointSpec(
        family="v3", num_layers=2, vocab_size=512))
    assert main(["bench", "--json", "model", "--model", str(checkpoint), "--baseline", "vllm",
                 "--vllm-python", sys.executable, "--prompt-len", "24", "--new-tokens", "16",
                 "--batch", "3", "--repeat", "2"]) in (0, 1)
    result = json.loads(capsys.readouterr().out)
    assert "error" not in result, result.get("error")
    info = result["baseline_info"]
    assert info["vllm_version"] == "0.32.0"
    # VLLM_PLUGINS=none: vLLM's own CPU MLA prefill and decode, not ours.
    assert info["registered"]["CPU_MLA"].startswith("vllm.")
    assert info["registered"]["prefill_CPU"].startswith("vllm.")
    assert info["engine_args"]["enable_prefix_caching"] is False
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for row in result["results"]:
        for side in ("ours", "vllm"):
            assert row[side]["prefill_tokens_per_s"] > 0
            assert row[side]["decode_tokens_per_s"] > 0
            assert row[side]["decode_measure"].startswith("within the run")
            assert 0 < row[side]["first_token_seconds"] < row[side]["generate_seconds"]
    assert len(result["targets"]) == 4
    assert result["peak_rss_bytes"]["baseline"] > 0 and result["peak_rss_bytes"]["ours"] > 0
