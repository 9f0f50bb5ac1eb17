"""``python -m app run`` and ``python -m app bench run`` on small sizes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cli import build_parser, main
from app.commands._output import ProgressBar
from tests.model.conftest import TINY

#: runs the whole engine through the CLI, some in fresh processes: outside the quick
#: subset (-m "not slow").
pytestmark = pytest.mark.slow

SMALL = ["--num-requests", "4", "--min-len", "8", "--max-len", "72", "--step-tokens", "48",
         "--min-new-tokens", "2", "--max-new-tokens", "6", "--num-blocks", "64",
         "--no-progress", "--no-malloc-tuning"]
EXAMPLE = Path(__file__).parents[2] / "examples" / "deployment.toml"


@pytest.fixture
def tiny_deployment(tmp_path: Path) -> Path:
    """A CPU deployment of a tiny layer (fast runs)."""
    path = tmp_path / "tiny.toml"
    path.write_text('[deployment]\nplatform = "cpu"\n[model]\ndtype = "float32"\n'
                    + "".join(f"{k} = {v}\n" for k, v in TINY.items()))
    return path


def _json(capsys: pytest.CaptureFixture[str]) -> Any:
    return json.loads(capsys.readouterr().out)


def _parse(argv: list[str]) -> Any:
    return build_parser().parse_args(argv)


def test_run_small_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--json", *SMALL, "--dtype", "float32", "--check-prefill-rows",
                 "-1"]) == 0
    result = _json(capsys)
    assert result["ok"] is True and result["malloc_tuned"] is False
    assert result["backend"]["chosen"] == "TORCH_SDPA"
    why_not = result["backend"]["why_not_others"]
    assert why_not.get("FLASHINFER")
    decode = result["decode_backend"]
    assert decode["chosen"] in ("CPU_MLA", "TORCH_SDPA") and decode["query_len"] == 1
    assert decode["why_not_others"].get("FLASHINFER_MLA") or "FLASHINFER_MLA" not in \
        decode["priorities"]
    check = result["check"]
    assert check["passed"] is True
    assert check["prefill_rows_checked"] == check["prefill_rows_computed"] > 0   # -1: all
    assert check["decode_rows_checked"] == check["decode_rows_computed"]   # <= 32 per request > 0
    assert check["prefill_rows_computed"] + check["decode_rows_computed"] == \
        result["prefill_tokens"] + result["decode_tokens"]
    assert check["tokens_checked"] == result["generated_tokens"]
    assert check["token_mismatches"] == 0
    assert check["prefill_max_relative_error"] < 1e-4
    assert check["decode_max_relative_error"] < 1e-4
    kv = result["kv_cache"]
    assert kv["leaked_blocks"] == 0
    assert kv["groups"][0]["spec"] == "MLAAttentionSpec"
    assert result["steps"] >= 2 and 0.0 <= result["prefix_cache_hit_rate"] < 1.0
    assert 8 <= result["generated_tokens"] <= 24
    for key in ("ttft_ms", "ttft_steps", "tpot_ms", "tpot_steps"):
        assert result[key]["p50"] is not None and result[key]["p99"] >= result[key]["p50"]
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0


def test_run_speculative_layers_and_check_sample(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--json", *SMALL, "--dtype", "float32", "--speculative-tokens", "3",
                 "--layers", "2", "--check-prefill-rows", "4", "--decode-backend",
                 "TORCH_SDPA"]) == 0
    result = _json(capsys)
    assert result["decode_backend"]["chosen"] == "TORCH_SDPA"
    assert result["decode_backend"]["requested"] == "TORCH_SDPA"
    assert result["decode_backend"]["query_len"] == 4
    assert result["model"]["num_hidden_layers"] == 2
    assert result["model"]["architecture"] == "DeepseekV3ForCausalLM"
    assert result["model"]["first_k_dense_replace"] == 1 and result["model"]["moe"]
    assert len(result["kv_cache"]["groups"]) == 1
    assert len(result["kv_cache"]["groups"][0]["layers"]) == 2
    spec = result["speculative"]
    assert spec["tokens"] == 3 and spec["drafts"] > 0
    check = result["check"]
    assert check["passed"] is True
    assert check["prefill_rows_checked"] < check["prefill_rows_computed"]
    assert check["decode_rows_checked"] == check["decode_rows_computed"]   # <= 32 per request


def test_run_text_summary_and_progress(capsys: pytest.CaptureFixture[str],
                                      tiny_deployment: Path) -> None:
    args = [a for a in SMALL if a != "--no-progress"]
    assert main(["run", *args, "--chunk-tokens", "16", "--block-size", "8", "--deployment",
                 str(tiny_deployment)]) == 0
    captured = capsys.readouterr()
    for label in ("platform", "backend", "not FLASHINFER", "decode TORCH_SDPA", "kv group 0",
                  "kv pool", "steps", "prefill", "decode", "TTFT", "TPOT", "prefix cache",
                  "max error", "rows checked", "tokens", "check time"):
        assert label in captured.out
    assert "PASS" in captured.out
    assert "\nthreads         " in captured.out and "OpenMP wait policy" in captured.out
    err = captured.err.splitlines()  # not a terminal: no bar, a few plain lines
    assert err[0].startswith("threads: ") and "(" in err[0]
    assert any(line.startswith("generate: done, ") and "decode" in line for line in err)
    assert any(line.startswith("checking against float64 (4 requests") for line in err)
    assert any(line.startswith("check: done, 4/4 in ") for line in err)
    assert not any("[" in line or "\r" in line for line in err), err
    assert len(err) == 4, err


def test_run_says_where_its_thread_count_came_from(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tiny_deployment: Path) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["run", "--json", *SMALL, "--deployment", str(tiny_deployment)]) == 0
    threads = _json(capsys)["threads"]
    assert threads["source"] == "OMP_NUM_THREADS=1"
    assert threads["count"] == torch.get_num_threads()
    assert isinstance(threads["wait_policy"], str) and threads["wait_policy"]


def test_run_says_when_a_native_kernel_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first build takes seconds: ``run`` says so. A fake engine build stands in for the
    loader's (tests/backends/cpu/test_loader.py checks the loader calls back)."""
    from app.backends.cpu import loader
    from app.commands import run as run_command

    def fake_execute(args: Any, stream: Any, threads: str) -> dict[str, Any]:
        stream.write(threads + "\n")
        loader._announce_build("mla_prefill_cpu")
        loader._announce_build("mla_decode_cpu")
        return {}

    monkeypatch.setattr(run_command, "_execute", fake_execute)
    args = [a for a in SMALL if a != "--no-progress"]
    stream = io.StringIO()
    parsed = _parse(["run", *args])
    run_command.execute(parsed, stream)
    lines = stream.getvalue().splitlines()
    assert lines[1:] == ["compiling the native kernels (first run, ~20 s): mla_prefill_cpu ...",
                         "compiling mla_decode_cpu ..."]
    loader._announce_build("after the run")  # no listener left behind
    assert stream.getvalue().count("\n") == 3


def test_run_fails_when_the_error_exceeds_the_tolerance(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tiny_deployment: Path) -> None:
    from app.mla import checks
    from app.model import reference

    monkeypatch.setitem(reference.REFERENCE_TOLERANCES, torch.float32, 0.0)
    monkeypatch.setattr(checks, "DTYPE_ERROR_FACTOR", 0.0)
    assert main(["run", "--json", *SMALL, "--deployment", str(tiny_deployment)]) == 1
    result = _json(capsys)
    assert result["ok"] is False and result["check"]["passed"] is False


def test_the_tolerance_follows_what_the_dtype_alone_costs(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 33: on a bf16 V3 test checkpoint the engine's error (3.4e-2) was the plain bf16
    model's own (4.0e-2), yet failed a fixed 3e-2. The tolerance is derived from that
    measurement, and the output says how."""
    pytest.importorskip("transformers")
    from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec, write_deepseek_checkpoint

    write_deepseek_checkpoint(tmp_path, DeepseekCheckpointSpec(family="v3"))
    assert main(["run", "--json", *SMALL, "--model", str(tmp_path)]) == 0
    check = _json(capsys)["check"]
    assert check["passed"] is True and check["token_mismatches"] == 0
    measured = check["dtype_max_relative_error"]
    # the plain bf16 model alone is past the fixed floor, so the floor alone would fail it
    # (the engine's own error sits on either side of it, by the CPU's bf16 kernel)
    assert measured > check["tolerance_floor"] == 3e-2
    assert check["max_relative_error"] <= check["tolerance"]
    assert check["tolerance"] == pytest.approx(2 * measured)
    assert check["tolerance_rule"] == (
        "max(3e-02, 2 x the relative error of the same dense model computed in bfloat16 "
        "against float64 on the rows checked)")
    assert main(["run", *SMALL, "--model", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"tolerance       {check['tolerance_rule']}; that model's error here:" in text


def test_run_refuses_a_request_that_can_never_fit(capsys: pytest.CaptureFixture[str],
                                                  tiny_deployment: Path) -> None:
    assert main(["run", *SMALL, "--min-len", "60", "--num-blocks", "4", "--deployment",
                 str(tiny_deployment)]) == 2
    err = capsys.readouterr().err
    assert "can never run" in err and "cache.num_blocks" in err


@pytest.mark.parametrize(("extra", "message"), [
    (["--min-len", "100", "--max-len", "10"], "--min-len"),
    (["--num-requests", "0"], "--num-requests"),
    (["--min-new-tokens", "9", "--max-new-tokens", "3"], "--min-new-tokens"),
    (["--speculative-tokens", "-1"], "--speculative-tokens"),
    (["--layers", "0"], "--layers"),
    (["--decode-backend", "NOPE"], "NOPE"),
    (["--backend", "NOPE"], "Unknown MLA prefill backend"),
    (["--backend", "FLASHINFER"], "not valid for this configuration"),
    (["--deployment", "/nonexistent/deploy.toml"], "deploy.toml"),
])
def test_run_usage_errors(capsys: pytest.CaptureFixture[str], extra: list[str],
                          message: str, tiny_deployment: Path) -> None:
    if "--deployment" not in extra:
        extra = [*extra, "--deployment", str(tiny_deployment)]
    assert main(["run", *SMALL, *extra]) == 2
    assert message in capsys.readouterr().err


def test_run_with_a_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--json", *SMALL, "--deployment", str(EXAMPLE)]) == 0
    result = _json(capsys)
    assert result["deployment"] == str(EXAMPLE)
    assert result["model"]["dtype"] == "bfloat16"
    assert result["model"]["source"] == "random (seed 0)"
    assert result["kv_cache"]["pool"]["num_blocks"] == 64


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_non_terminal_is_one_closing_line_for_quick_work() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(20, "work", stream=stream, clock=clock)
    for i in range(1, 21):
        clock.now += 0.1
        bar.update(i, "info")
    assert stream.getvalue() == ""  # no bar, no line per step
    bar.close()
    bar.close()  # once
    assert stream.getvalue() == "work: done, 20/20 in 2.0 s, info\n"


def test_progress_on_a_non_terminal_is_never_silent_for_long() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(10, "check", stream=stream, clock=clock, heartbeat=10.0)
    for i in range(1, 11):
        clock.now += 4.0
        bar.update(i)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["check: 30% (3/10) after 12.0 s", "check: 60% (6/10) after 24.0 s",
                     "check: 90% (9/10) after 36.0 s", "check: done, 10/10 in 40.0 s"]
    assert not any("[" in line or "#" in line or "\r" in line for line in lines)


def test_progress_on_a_terminal_redraws_one_line() -> None:
    tty = Tty()
    bar = ProgressBar(3, "work", stream=tty)
    for i in range(1, 4):
        bar.update(i)
    bar.note("compiling x ...")
    bar.close()
    text = tty.getvalue()
    assert text.startswith("\rwork [") and "3/3" in text and text.endswith("\n")
    assert "\r\x1b[Kcompiling x ...\nwork [" in text  # the note above the bar, redrawn
    assert text.count("\n") == 2
    quiet = io.StringIO()
    off = ProgressBar(5, "x", stream=quiet, enabled=False)
    off.update(5)
    off.note("hidden")
    off.close()
    assert quiet.getvalue() == ""


def test_malloc_tuning_in_a_fresh_process() -> None:
    code = ("from app.mla.process import tune_malloc_for_large_tensors as tune\n"
            "import torch\nprint(tune()); x = torch.ones(50_000_000); del x\n"
            "print(float(torch.ones(60_000_000).sum()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    applied, total = proc.stdout.split()
    assert applied == str(sys.platform.startswith("linux")) and float(total) == 6e7


def test_bench_run_small(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--json", "run", "--decode-requests", "4", "--min-context", "40",
                 "--max-context", "90", "--documents", "2", "--decode-steps", "2",
                 "--context-len", "64", "--new-tokens", "32", "--requests-per-step", "2",
                 "--steps", "1", "--dtype", "float32", "--chunk-tokens", "48",
                 "--no-malloc-tuning"])
    result = _json(capsys)
    assert code == (0 if result["ok"] else 1)
    assert next(iter(result)) == "threads"  # first: how many threads, and why
    assert result["threads"]["count"] == torch.get_num_threads()
    assert result["threads"]["source"]
    decode, prefill = result["mixes"]
    assert decode["mix"] == "decode-heavy" and decode["workload"]["running_requests"] == 4
    assert 40 <= decode["workload"]["mean_context"] <= 92
    assert decode["phase_seconds_per_step"]["attention_decode"] > 0
    assert decode["decode_tokens_per_s"] > 0 and decode["steps_per_s"] > 0
    assert set(decode["targets"]) == {"scheduler_and_kv_bookkeeping_share_of_step"}
    assert prefill["workload"]["context_len"] == 64
    assert set(prefill["targets"]) == {"attention_kernels_share_of_step",
                                       "merge_and_bookkeeping_share_of_step"}
    phases = prefill["phase_seconds_per_step"]
    assert phases["attention_context"] > 0 and phases["gather"] > 0
    assert prefill["prefill_tokens_per_s"] > 0


def test_run_on_a_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``run --model DIR``: the main job's workload on a Hugging Face checkpoint, checked
    against the float64 model of the loaded weights."""
    pytest.importorskip("transformers")
    from tests.model.hf_checkpoints import hf_model

    hf_model("v2_lite").save_pretrained(tmp_path)
    assert main(["run", "--json", *SMALL, "--model", str(tmp_path), "--dtype", "float32"]) == 0
    result = _json(capsys)
    assert result["ok"] is True and result["check"]["passed"] is True
    model = result["model"]
    assert model["source"] == str(tmp_path) and model["architecture"] == "DeepseekV2ForCausalLM"
    assert model["q_lora_rank"] is None and model["load"]["tensors"] > 0
    assert result["check"]["token_mismatches"] == 0
    assert main(["run", *SMALL, "--model", str(tmp_path), "--layers", "2"]) == 2
    assert "--layers sets the random model's depth" in capsys.readouterr().err
