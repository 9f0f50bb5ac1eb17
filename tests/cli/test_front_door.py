"""Hostile command lines (no corpus file needed): each is one line on stderr, exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from app.cli import main
from tests.cli.conftest import CliRunner, assert_one_line_usage_error

GOOD_PLAN = """[[layers]]
name = "l.{i}"
count = 2
spec = "mla"
kv_lora_rank = 512
qk_rope_head_dim = 64
dtype = "bfloat16"
"""


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(GOOD_PLAN)
    return path


def test_a_good_plan_runs(run_cli: CliRunner, plan_file: Path) -> None:
    code, out, err = run_cli("kv-plan", "--config", str(plan_file), "--memory", "1GiB")
    assert code == 0 and err == "" and "2 layers" in out


@pytest.mark.parametrize("argv, expected", [
    (["kv-plan", "--config", "{dir}"], ["config file", "is a directory; expected a TOML file"]),
    (["backends", "--deployment", "{dir}"], ["deployment file", "is a directory"]),
    (["run", "--deployment", "{dir}"], ["deployment file", "is a directory"]),
    (["kv-plan", "--config", "{plan}", "--memory", "1e999"],
     ["--memory: expected a finite size"]),
    (["kv-plan", "--config", "{plan}", "--memory", "inf"], ["--memory: cannot read 'inf'"]),
    (["kv-plan", "--config", "{plan}", "--memory", "2EiB"], ["--memory: cannot read '2EiB'"]),
    (["kv-plan", "--config", "{plan}", "--max-model-len", "1_000"],
     ["argument --max-model-len: expected an int in [1, 2147483647], got '1_000'"]),
    (["bench", "kv", "--quick", "--block-size", "0"],
     ["argument --block-size: expected an int in [1, 2147483647], got 0"]),
    (["bench", "kv", "--quick", "--vllm-timeout", "nan"],
     ["argument --vllm-timeout: expected a positive, finite number, got 'nan'"]),
    (["bench", "prefill", "--device", "tpu"],
     ["argument --device: expected cpu, cuda or cuda:N, got 'tpu'"]),
    (["bench", "prefill", "--heads", "9223372036854775807"],
     ["argument --heads: expected an int in [1, 1024]"]),
    (["bench", "selection", "--output", "{dir}"],
     ["argument --output:", "is a directory; expected a file path"]),
    (["bench", "selection", "--output", "{dir}/no/such/folder/x.json"],
     ["argument --output:", "does not exist"]),
    (["bench", "run", "--steps", "-1"], ["argument --steps: expected an int in [1, 2147483647]"]),
    (["backends", "--capability", "99.9"], ["--capability '99.9': expected 'cpu' or MAJOR.MINOR"]),
    (["backends", "--capability", "1_0.0"], ["--capability '1_0.0'"]),
    (["backends", "--capability", "\u0969.\u0966"], ["expected 'cpu' or MAJOR.MINOR with ASCII"]),
    (["backends", "--capability", "1" * 23 + ".0"], ["expected 'cpu' or MAJOR.MINOR"]),
    (["backends", "--capability", "10.10"], ["minor 0-9"]),
    (["backends", "--mla-dimensions", "1_28,64,128"], ["--mla-dimensions: expected three"]),
    (["backends", "--mla-dimensions", "128,64,99999999"], ["--mla-dimensions: expected three"]),
    (["run", "--num-requests", "0"], ["argument --num-requests: expected an int in [1, "]),
    (["run", "--num-blocks", "1e9"], ["argument --num-blocks: expected an int in [2, "]),
    (["run", "--max-len", str(2**31 - 1), "--no-progress"],
     ["--max-len 2147483647: a request that long can never run: it needs 134217728 blocks",
      "usable"]),
    (["backends", "--kind", "decode", "--query-len", "0"],
     ["argument --query-len: expected an int in [1, 16], got 0"]),
    (["bench", "run", "--seed", "-5"], ["argument --seed: expected an int in [0, "]),
    (["bench", "decode", "--device", "tpu"],
     ["argument --device: expected cpu, cuda or cuda:N, got 'tpu'"]),
    (["bench", "decode", "--block-size", "0"], ["argument --block-size: expected an int in [1, "]),
    (["bench", "decode", "--stream-gib", "inf"], ["argument --stream-gib: expected a positive"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "(see python -m app --help)"]),
])
def test_hostile_command_line(run_cli: CliRunner, tmp_path: Path, plan_file: Path,
                              argv: list[str], expected: list[str]) -> None:
    argv = [a.replace("{dir}", str(tmp_path)).replace("{plan}", str(plan_file)) for a in argv]
    code, out, err = run_cli(*argv)
    assert_one_line_usage_error(code, err, *expected)
    assert out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("bench", ["prefill", "decode"])
def test_bench_on_cuda_without_a_gpu(run_cli: CliRunner, bench: str) -> None:
    code, _, err = run_cli("bench", bench, "--quick", "--device", "cuda")
    assert_one_line_usage_error(code, err, "--device cuda: CUDA is not available on this machine",
                                "use --device cpu")


def test_an_unreadable_file_names_it(run_cli: CliRunner, plan_file: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Root reads a mode-000 file anyway: make the open fail as it does for other users.
    real = os.open

    def open_(path: object, flags: int, *args: int) -> int:
        if Path(os.fspath(path)) == plan_file:  # type: ignore[arg-type]
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", open_)
    for argv in (["kv-plan", "--config"], ["backends", "--deployment"], ["run", "--deployment"]):
        code, _, err = run_cli(*argv, str(plan_file))
        assert_one_line_usage_error(code, err, str(plan_file), "cannot be read: permission denied")


def test_num_blocks_is_bounded_by_memory(run_cli: CliRunner) -> None:
    # int32 block ids allow 2**31 - 1 blocks; at 18 KiB each no machine here holds them, and
    # building the pool would take minutes: refused up front, saying how many would fit.
    code, _, err = run_cli("run", "--num-blocks", str(2**31 - 1), "--no-progress")
    assert_one_line_usage_error(code, err, "cache.num_blocks = 2147483647 needs",
                                "GiB of cpu memory", "use at most")


def test_bench_run_pool_is_bounded_by_memory(run_cli: CliRunner) -> None:
    # 4 requests of 10**8 context tokens: ~25 million blocks of 18 KiB each, refused up front:
    # before the decode mix (which fits) runs for minutes, not after it.
    code, _, err = run_cli("bench", "run", "--context-len", str(10**8), "--block-size", "16",
                           "--no-malloc-tuning")
    assert_one_line_usage_error(code, err, "needs", "GiB of cpu memory", "use at most")


def test_an_unexpected_error_is_one_line_too(run_cli: CliRunner,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import app.commands.platform as platform_command

    def explode() -> dict[str, object]:
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(platform_command, "collect", explode)
    code, _, err = run_cli("platform")
    assert code == 1
    assert err == ("error: unexpected RuntimeError: something broke (run with -vv for the "
                   "traceback)\n")


def test_help_still_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "usage:" in capsys.readouterr().out
