"""``python -m app bench decode --quick``: the JSON it prints, its figures and its targets."""

from __future__ import annotations

import json

import pytest
import torch

from app.bench import decode
from app.cli import main


def test_quick_benchmark_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--json", "decode", "--quick", "--repeat", "1", "--stream-gib",
                 "0.01", "--block-size", "16"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"] is True and result["errors"] == []
    assert result["stream_gbs"] > 0 and result["matmul_fp32_gflops"] > 0
    assert result["block_size"] == 16 and result["cpu"]["model"]
    names = {c.name for c in decode.default_cases(quick=True)}
    assert result["results"], result
    for row in result["results"]:
        assert row["case"] in names and row["ms"] > 0 and row["gflops"] > 0
        assert row["roofline_fraction"] > 0 and row["bound_by"] in ("memory", "compute")
        if row["backend"] != "TORCH_SDPA":
            assert row["baseline"] == "TORCH_SDPA" and row["speedup_vs_baseline"] > 0
    assert result["targets"] == []  # the targets are on the full-size cases only


def test_readable_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--quick", "--repeat", "1", "--stream-gib", "0.01",
                 "--no-baseline", "--backends", "TORCH_SDPA"]) == 0
    text = capsys.readouterr().out
    assert "TORCH_SDPA" in text and "roofline" in text


def test_bad_arguments() -> None:
    assert main(["bench", "decode", "--quick", "--backends", "NOPE"]) == 2
    assert main(["bench", "decode", "--quick", "--block-size", "0"]) == 2
    assert main(["bench", "decode", "--quick", "--stream-gib", "0"]) == 2


def test_flops_bytes_and_targets() -> None:
    case = decode.Case("64x4k q4", 64, 4096, query_len=4)
    seen = 4096 * 4 - 6                                   # rows see 4093, 4094, 4095, 4096
    assert case.flops() == 2 * (2 * 512 + 64) * 16 * 64 * seen
    assert case.cache_bytes(torch.bfloat16) == 64 * 4096 * 576 * 2
    rows = [{"backend": "CPU_MLA", "case": "16x8k", "roofline_fraction": 0.69,
             "speedup_vs_baseline": 7.0},
            {"backend": "CPU_MLA", "case": "1x32k", "roofline_fraction": 0.1,
             "speedup_vs_baseline": 4.0}]
    verdicts = [(t["name"], t["pass"]) for t in decode._targets(rows)]
    assert verdicts == [("CPU_MLA 16x8k roofline fraction", False),
                        ("CPU_MLA 16x8k speed-up over TORCH_SDPA", True),
                        ("CPU_MLA 1x32k speed-up over TORCH_SDPA", False)]


def test_peak_extra_memory_sees_an_allocation() -> None:
    if decode.peak_extra_bytes(lambda: None, torch.device("cpu")) is None:
        pytest.skip("no /proc/self/clear_refs here")
    extra = decode.peak_extra_bytes(lambda: torch.ones(64 << 20, dtype=torch.uint8).sum(),
                                    torch.device("cpu"))
    assert extra is not None and extra >= 60 << 20
