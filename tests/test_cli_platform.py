"""``python -m app platform``: text and JSON output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.backends.cpu.prefill_kernel import native_kernel_status
from app.cli import main


def test_platform_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("platform", "device_type", "device_capability", "torch_version",
                "kernel_packages"):
        assert key in data
    assert data["torch_version"] == torch.__version__
    status = native_kernel_status()
    assert data["cpu_native_kernel"] == (
        f"available ({status.library})" if status.available
        else f"unavailable: {'; '.join(status.reasons)}")
    modules = {p["module"]: p for p in data["kernel_packages"]}
    assert set(modules) >= {"flashinfer", "tokenspeed_mla", "flash_attn", "flash_attn.cute"}
    for entry in modules.values():
        assert isinstance(entry["imports"], bool)
        assert (entry["error"] is None) == entry["imports"]


def test_platform_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform"]) == 0
    out = capsys.readouterr().out
    assert "platform" in out and "torch_version" in out and "imports" in out
    threads = [line for line in out.splitlines() if line.startswith("threads ")]
    assert len(threads) == 1 and f" {torch.get_num_threads()} (" in threads[0], out


@pytest.mark.parametrize("environ", [{"OMP_NUM_THREADS": "1"}, {}])
def test_platform_says_where_the_thread_count_came_from(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        environ: dict[str, str]) -> None:
    """The machine faked whole: as many CPUs in the affinity mask as torch runs threads,
    no cgroup files."""
    from app import _threads

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    n = torch.get_num_threads()
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(n)))
    monkeypatch.setattr(_threads, "CGROUP_ROOT", tmp_path / "no-cgroup")
    monkeypatch.setattr(_threads, "PROC_SELF_CGROUP", tmp_path / "no-proc-self-cgroup")
    monkeypatch.setattr(_threads, "_applied", None)
    assert main(["platform", "--json"]) == 0
    threads = json.loads(capsys.readouterr().out)["threads"]
    assert threads["source"] == ("OMP_NUM_THREADS=1" if environ
                                 else f"affinity {n} CPU{'s' if n > 1 else ''}")
    assert threads["count"] == n  # OMP_NUM_THREADS set now: torch read it at its start
    assert threads["wait_policy"] == _threads.wait_policy()


def test_module_entry_point_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "app", "platform", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["platform"] in ("cpu", "cuda")


def test_unknown_subcommand_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "--help" in err
    assert err.count("\n") == 1, err  # one line, no usage block
