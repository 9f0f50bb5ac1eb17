"""Benchmark flags that would exhaust memory (issue 21) are refused when they are parsed or
before anything is allocated, with one line naming the flag and the memory there is."""

from __future__ import annotations

import pytest

from app.bench import kv
from app.commands import _args, _memory
from tests.cli.conftest import CliRunner, assert_one_line_usage_error
from tests.cli.conftest import run_cli as run_cli  # the fixture


@pytest.fixture
def eight_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the host has 8 GiB available, whatever this machine has."""
    monkeypatch.setattr(_memory, "available_host_bytes", lambda: 8 << 30)
    monkeypatch.setattr(_args, "available_host_bytes", lambda: 8 << 30)


@pytest.mark.usefixtures("eight_gib")
@pytest.mark.parametrize("argv, expected", [
    # 1 TiB: it ended in "unexpected RuntimeError" after trying to allocate it.
    (["bench", "decode", "--stream-gib", "1e3"],
     ["argument --stream-gib: '1e3' GiB is more than half the host memory available now "
      "(8.0 GiB); use at most 4.00"]),
    # 0 elements: the bandwidth read 0 and the roofline divided by it (ZeroDivisionError).
    (["bench", "decode", "--stream-gib", "1e-12"],
     ["argument --stream-gib: expected at least 0.0009765625 GiB (1 MiB), got '1e-12'"]),
    (["bench", "decode", "--stream-gib", "nan"], ["argument --stream-gib: expected a positive"]),
    # Every request padded to one block of 2**31 - 1 rows: 442369 GiB of cache.
    (["bench", "decode", "--quick", "--block-size", "2147483647"],
     ["bench decode with --block-size 2147483647 and --stream-gib 0.0625 needs",
      "GiB of host memory; this machine has 8.0 GiB available now"]),
    (["bench", "decode", "--quick", "--backends", ","],
     ["--backends: unknown ','; known: ['CPU_MLA'"]),
    # These grew until a MemoryError (or the OOM killer).
    (["bench", "kv", "--tokens", "2147483647"],
     ["bench kv with --requests 256, --tokens 2147483647", "needs 13696.0 GiB of host memory"]),
    (["bench", "kv", "--requests", "2147483647"], ["needs 438272.0 GiB of host memory"]),
    (["bench", "kv", "--lookups", "2147483647"], ["needs 32.1 GiB of host memory"]),
])
def test_memory_hungry_flags_are_refused_up_front(run_cli: CliRunner, argv: list[str],
                                                  expected: list[str]) -> None:
    code, out, err = run_cli(*argv)
    assert_one_line_usage_error(code, err, *expected)
    assert out == ""


def test_the_kv_estimate_matches_the_default_workload() -> None:
    # Measured: the default workload raises the peak RSS by ~73 MB over a tiny one.
    w = {"requests": 256, "tokens": 8192, "block_size": 16, "lookups": 1_000_000}
    assert 50e6 < kv.workload_bytes(w) < 100e6


def test_available_host_memory_is_read() -> None:
    have = _memory.available_host_bytes()
    assert have is None or have > 0
