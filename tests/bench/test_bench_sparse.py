"""``python -m app bench sparse``: a quick run reports every part of both rows with its bytes,
FLOPs and roofline fractions, and the speed-up over dense attention; bad sizes are refused."""

from __future__ import annotations

import json

import pytest

from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.cli import main

needs_kernel = pytest.mark.skipif(not CpuSparseDecodeBackend.is_available(),
                                  reason="the native CPU sparse kernel cannot run here")


@needs_kernel
def test_a_quick_run_reports_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sparse", "--quick", "--json", "--repeat", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["targets"] == []
    decode, prefill = result["rows"]
    assert (decode["row"], decode["requests"], decode["context"], decode["topk"]) == (
        "decode", 2, 2048, 256)
    assert decode["indexer_class"] == "CpuSparseIndexer" and prefill["tokens"] == 512
    for row in (decode, prefill):
        for part in ("indexer", "attention", "total", "dense"):
            figures = row[part]
            assert figures["ms"] > 0 and figures["mb"] > 0 and figures["gflop"] > 0
            assert figures["roofline_fraction"] >= figures["byte_roofline_fraction"] > 0
        assert row["speedup_vs_dense"] > 0
    # the decode step reads the index keys and the picked rows, dense reads every row
    assert decode["attention"]["mb"] == pytest.approx(decode["dense"]["mb"] * 256 / 2048,
                                                      rel=0.05)


@pytest.mark.parametrize(("flag", "value"), [("--requests", "0"), ("--topk", "0"),
                                             ("--prefill-len", "-1"), ("--index-dim", "1")])
def test_bad_sizes_are_refused(flag: str, value: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sparse", flag, value]) == 2
    assert f"{flag} must be >=" in capsys.readouterr().err
