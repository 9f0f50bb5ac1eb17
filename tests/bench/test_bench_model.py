"""``python -m app bench model``: its arguments, its targets, and the whole-vLLM baseline's
runner and line protocol against a stand-in worker (the real one needs vLLM: see
``tests/integrations/test_bench_model_vllm.py``)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from app.bench import model as bench_model
from app.bench.vllm.model import WholeVLLM, check_vllm_python
from app.cli import main

#: runs the model benchmark: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

#: A stand-in for the vLLM environment's python: runs the real worker's ``--serve`` (its line
#: protocol, its stdout redirection) with vLLM's engine replaced by a recorder.
STAND_IN = textwrap.dedent("""
    import json, sys
    import app.bench.vllm.engine_worker as worker

    mode = sys.argv[1]
    sys.argv[1:] = sys.argv[4:]        # "-m app.bench.vllm.engine_worker --serve" -> "--serve"

    def build(engine):
        if mode == "broken":
            raise RuntimeError("no engine today")
        print("vLLM would log this line on stdout")
        return {"engine": engine}, 0.25

    def run_job(llm, job):
        if job["max_tokens"] == 99:
            raise RuntimeError("job refused")
        n = len(job["prompts"]) * job["max_tokens"]
        timeline = {"first_token_seconds": [0.015], "decode_tokens": [n - len(job["prompts"])]}
        return {"name": job["name"], "seconds": [0.01 * job["max_tokens"]],
                "generated_tokens": n if mode != "short" else n - 1,
                "echo": llm["engine"]["max_num_seqs"],
                **(timeline if job.get("timeline") and mode != "bare" else {})}

    worker._build = build
    worker._run_job = run_job
    worker._registered = lambda: {"CPU_MLA": "vllm.stand.in"}
    worker._vllm_version = lambda: "0.0-stand-in"
    sys.exit(worker.main(sys.argv[1:]))
""")


def _stand_in(tmp_path: Path, mode: str = "ok") -> str:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / f"python-{mode}"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} {mode} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


def _options(python: str | None, **extra: Any) -> Any:
    import argparse

    return argparse.Namespace(vllm_python=python, prompt_len=8, new_tokens=4, batch=3,
                              vllm_timeout=60.0, **extra)


def test_arguments_are_checked_before_anything_runs(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APP_BENCH_VLLM_PYTHON", raising=False)
    assert main(["bench", "model", "--baseline", "nope"]) == 2
    assert main(["bench", "model", "--new-tokens", "1"]) == 2
    assert main(["bench", "model", "--baseline", "vllm"]) == 2
    assert main(["bench", "model", "--baseline", "vllm", "--vllm-python",
                 str(tmp_path / "no-python")]) == 2
    with pytest.raises(ValueError, match="needs --vllm-python"):
        check_vllm_python(None)
    with pytest.raises(ValueError, match="no such file"):
        check_vllm_python(str(tmp_path))


def test_targets_follow_the_baseline() -> None:
    rows = [{"batch": 1, "prefill_speedup": 2.5, "decode_speedup": 1.2},
            {"batch": 16, "prefill_speedup": 1.9, "decode_speedup": 6.0}]
    vllm = bench_model._targets("vllm", rows)
    assert {k: v["pass"] for k, v in vllm.items()} == {
        "prefill_speedup_at_batch_1": True, "decode_speedup_at_batch_1": False,
        "prefill_speedup_at_batch_16": False, "decode_speedup_at_batch_16": True}
    assert vllm["prefill_speedup_at_batch_1"]["target"] == ">= 2.0"
    transformers = bench_model._targets("transformers", rows)
    assert list(transformers) == ["decode_speedup_at_batch_16"]
    assert transformers["decode_speedup_at_batch_16"]["pass"]


def test_the_vllm_runner_keeps_one_worker_and_reads_only_its_answers(tmp_path: Path) -> None:
    runner = WholeVLLM(tmp_path, __import__("torch").bfloat16, _options(_stand_in(tmp_path)))
    try:
        assert runner.engine["max_num_seqs"] == 3 and not runner.engine["enable_prefix_caching"]
        assert runner.engine["max_model_len"] == 8 + 4 + 16
        timing = runner([[5, 6], [7, 8]], 3)     # the job steps the engine: its timeline
        assert timing.seconds == pytest.approx(0.03)
        assert (timing.first_token_seconds, timing.decode_tokens) == (0.015, 4)
        assert runner([[5, 6]], 1).seconds == pytest.approx(0.01)
        info = runner.describe()
        assert info["vllm_version"] == "0.0-stand-in" and info["init_s"] == 0.25
        assert info["registered"] == {"CPU_MLA": "vllm.stand.in"}
        assert info["peak_rss_bytes"] > 0
        with pytest.raises(RuntimeError, match="job refused"):
            runner([[5]], 99)
        assert runner([[5]], 2).seconds == pytest.approx(0.02)   # the worker is still there
    finally:
        runner.close()
    assert runner._proc.poll() == 0


@pytest.mark.parametrize(("mode", "message"), [("broken", "no engine today"),
                                                ("short", "generated 5 tokens, expected 6")])
def test_vllm_failures_are_errors(tmp_path: Path, mode: str, message: str) -> None:
    import torch

    with pytest.raises(RuntimeError, match=message):
        runner = WholeVLLM(tmp_path, torch.bfloat16, _options(_stand_in(tmp_path, mode)))
        try:
            runner([[1, 2], [3, 4]], 3)
        finally:
            runner.close()


def test_a_worker_that_dies_is_reported(tmp_path: Path) -> None:
    import torch

    dead = tmp_path / "python-dead"
    dead.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    dead.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited .*cannot start"):
        WholeVLLM(tmp_path, torch.bfloat16, _options(str(dead)))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec, write_deepseek_checkpoint

    return write_deepseek_checkpoint(
        tmp_path_factory.mktemp("bench-model") / "v3",
        DeepseekCheckpointSpec(family="v3", num_layers=2, num_heads=2, vocab_size=256))


def test_bench_model_against_a_stand_in_vllm(tiny_checkpoint: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json", "model", "--model", str(tiny_checkpoint), "--baseline",
                 "vllm", "--vllm-python", _stand_in(tmp_path), "--prompt-len", "8",
                 "--new-tokens", "3", "--batch", "2", "--repeat", "1", "--threads", "1"]) in (0, 1)
    result = json.loads(capsys.readouterr().out)
    assert "error" not in result and result["torch_threads"] == 1
    assert [r["batch"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        theirs = row["vllm"]
        assert theirs["prefill_seconds"] == pytest.approx(0.01, abs=1e-4)
        assert theirs["generate_seconds"] == pytest.approx(0.03, abs=1e-4)
        # the stand-in says every first token came at 15 ms, then 2 tokens per request
        assert theirs["first_token_seconds"] == pytest.approx(0.015, abs=1e-4)
        assert theirs["decode_tokens_per_s"] == pytest.approx(
            row["batch"] * 2 / 0.015, rel=1e-2)
        # ours: measured inside the 3-token run, so never 0.0 however busy the machine
        # (issue 38: it was the difference of two runs, 0.0 when the longer was no longer)
        assert row["ours"]["prefill_tokens_per_s"] > 0 and row["ours"]["decode_tokens_per_s"] > 0
        assert row["ours"]["decode_measure"].startswith("within the run")
        assert 0 < row["ours"]["first_token_seconds"] < row["ours"]["generate_seconds"]
    assert set(result["targets"]) == {f"{k}_speedup_at_batch_{b}" for k in ("prefill", "decode")
                                      for b in (1, 2)}
    assert result["baseline_info"]["vllm_version"] == "0.0-stand-in"
    assert result["peak_rss_bytes"]["ours"] > 0 and result["peak_rss_bytes"]["baseline"] > 0
    assert result["ok"] == all(t["pass"] for t in result["targets"].values())


def test_bench_model_against_transformers(tiny_checkpoint: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "model", "--model", str(tiny_checkpoint), "--prompt-len", "8",
                 "--new-tokens", "3", "--batch", "2", "--repeat", "1"]) in (0, 1)
    text = capsys.readouterr().out
    assert "baseline transformers" in text and "batch   2: prefill" in text
    assert "target decode_speedup_at_batch_2" in text


def test_decode_rates_come_from_inside_one_run_and_bare_seconds_still_work() -> None:
    from app.bench._timing import RunTiming

    # A busy machine: the 1-token run (0.5 s) took longer than the whole 4-token run (0.4 s);
    # the difference of the two was 0.0 tokens/s, inside the run it is 6 tokens in 0.1 s.
    inside = bench_model._rates(0.5, RunTiming(0.4, 0.3, 6), 2, 8, 4)
    assert inside["decode_tokens_per_s"] == 60.0 and inside["decode_seconds"] == 0.1
    assert inside["first_token_seconds"] == 0.3 and inside["prefill_tokens_per_s"] == 32.0
    bare = bench_model._rates(0.1, RunTiming(0.4), 2, 8, 4)    # a runner of the old form
    assert bare["decode_tokens_per_s"] == 20.0 and bare["decode_measure"].startswith("difference")
    assert bench_model._rates(0.5, RunTiming(0.4), 2, 8, 4)["decode_tokens_per_s"] is None
    assert bench_model._speedups(bare, {**bare, "decode_tokens_per_s": None}) == {
        "prefill_speedup": 1.0, "decode_speedup": None}
    runs = [RunTiming(1.0, 0.5, 10), RunTiming(0.9, 0.2, 10), RunTiming(0.8)]
    assert bench_model._best_run(runs) == RunTiming(1.0, 0.5, 10)     # 20 tokens/s
    assert bench_model._best_run([RunTiming(0.8), RunTiming(0.7)]) == RunTiming(0.7)


def test_a_baseline_without_a_timeline_falls_back_to_two_runs(tmp_path: Path) -> None:
    runner = WholeVLLM(tmp_path, torch.bfloat16, _options(_stand_in(tmp_path, "bare")))
    try:
        timing = runner([[5, 6], [7, 8]], 3)
        assert timing.seconds == pytest.approx(0.03) and timing.first_token_seconds is None
    finally:
        runner.close()
