"""``python -m app bench decode --quick``: the JSON it prints, its figures and its targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.bench import decode
from app.cli import main

#: runs the decode benchmark: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow


def test_quick_benchmark_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--json", "decode", "--quick", "--repeat", "1", "--stream-gib",
                 "0.01", "--block-size", "16"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"] is True and result["errors"] == []
    assert result["stream_gbs"] > 0 and result["matmul_fp32_gflops"] > 0
    assert result["block_size"] == 16 and result["cpu"]["model"]
    assert result["cache_dtypes"] == ["bf16", "fp32"] and result["vllm_comparison"] is None
    names = {c.name for c in decode.default_cases(quick=True)}
    assert result["results"], result
    assert {row["dtype"] for row in result["results"]} == {"bf16", "fp32"}
    for row in result["results"]:
        assert row["case"] in names and row["ms"] > 0 and row["gflops"] > 0
        assert row["roofline_fraction"] > 0 and row["bound_by"] in ("memory", "compute")
        assert row["matmul_roofline_fraction"] > 0
        # the roofline is max(bytes / stream, FLOPs / the bounding peak), over the best time
        roofline = row["roofline_ms"] / row["ms"]
        assert row["roofline_fraction"] == pytest.approx(roofline, rel=2e-2, abs=2e-3)
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
    assert main(["bench", "decode", "--quick", "--dtypes", "fp8"]) == 2


def test_flops_bytes_and_targets() -> None:
    case = decode.Case("64x4k q4", 64, 4096, query_len=4)
    seen = 4096 * 4 - 6                                   # rows see 4093, 4094, 4095, 4096
    assert case.flops() == 2 * (2 * 512 + 64) * 16 * 64 * seen
    assert case.cache_bytes(torch.bfloat16) == 64 * 4096 * 576 * 2
    rows = [{"backend": "CPU_MLA", "case": "16x8k", "dtype": "bf16", "roofline_fraction": 0.9,
             "roofline_fraction_paired": 0.69, "speedup_vs_baseline": 7.0},
            {"backend": "CPU_MLA", "case": "1x32k", "dtype": "bf16", "roofline_fraction": 0.1,
             "speedup_vs_baseline": 4.0},
            {"backend": "CPU_MLA", "case": "16x8k h128", "dtype": "fp32",
             "roofline_fraction": 0.71, "roofline_fraction_paired": None,
             "speedup_vs_baseline": 2.0}]
    targets = decode._targets(rows)
    verdicts = [(t["name"], t["pass"]) for t in targets]
    assert verdicts == [("CPU_MLA 16x8k bf16 roofline fraction", False),   # the paired figure
                        ("CPU_MLA 16x8k bf16 speed-up over TORCH_SDPA", True),
                        ("CPU_MLA 1x32k bf16 speed-up over TORCH_SDPA", False),
                        ("CPU_MLA 16x8k h128 fp32 roofline fraction", True)]
    assert [t.get("measure") for t in targets] == ["roofline_fraction_paired", None, None,
                                                   "roofline_fraction"]


def test_peak_extra_memory_sees_an_allocation() -> None:
    if decode.peak_extra_bytes(lambda: None, torch.device("cpu")) is None:
        pytest.skip("no /proc/self/clear_refs here")
    extra = decode.peak_extra_bytes(lambda: torch.ones(64 << 20, dtype=torch.uint8).sum(),
                                    torch.device("cpu"))
    assert extra is not None and extra >= 60 << 20


FAKE_VLLM_INIT = '__version__ = "0.0-fake"\n'
FAKE_VLLM_PLATFORMS = '''
import torch


class _Platform:
    def import_kernels(self):
        """Registers torch.ops._C.mla_decode_kvcache: vLLM's signature, float64 math."""
        lib = torch.library.Library("_C", "DEF")
        lib.define("mla_decode_kvcache(Tensor(a!) out, Tensor query, Tensor kv_cache, "
                   "float scale, Tensor block_tables, Tensor seq_lens) -> ()")

        def decode(out, query, kv_cache, scale, block_tables, seq_lens):
            bs = kv_cache.shape[1]
            for b, n in enumerate(seq_lens.tolist()):
                pos = torch.arange(n)
                kv = kv_cache[block_tables[b].long()[pos // bs], pos % bs].double()
                p = torch.softmax(query[b].double() @ kv.t() * scale, dim=-1)
                out[b] = (p @ kv[:, :out.shape[-1]]).to(out.dtype)

        lib.impl("mla_decode_kvcache", decode, "CPU")
        _Platform.lib = lib


current_platform = _Platform()
'''


def _fake_vllm_python(tmp_path: Path) -> Path:
    """A python whose ``vllm`` is a stand-in with vLLM's decode op signature."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM_INIT)
    (package / "platforms.py").write_text(FAKE_VLLM_PLATFORMS)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{package.parent}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o700)
    return wrapper


@pytest.mark.skipif(not CpuMLADecodeBackend.is_available(), reason="no native decode kernel")
def test_vllm_comparison_runs_the_other_side_on_the_same_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--json", "decode", "--quick", "--repeat", "1", "--stream-gib", "0.01",
                 "--no-baseline", "--backends", "CPU_MLA", "--dtypes", "bf16,fp32",
                 "--vllm-python", str(_fake_vllm_python(tmp_path))])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"] is True, result["errors"]
    comparison = result["vllm_comparison"]
    assert comparison["vllm"]["vllm_version"] == "0.0-fake"
    rows = comparison["results"]
    expected = [(c.name, dt) for dt in ("bf16", "fp32")
                for c in decode.default_cases(quick=True) if c.query_len == 1]
    assert [(r["case"], r["dtype"]) for r in rows] == expected
    for row in rows:   # the other side read the same cache: its output agrees with ours
        assert row["block_size"] == 16 and row["outputs_agree"], row
        assert row["ours_ms"] > 0 and row["vllm_ms"] > 0 and row["speedup"] > 0


def test_vllm_comparison_reports_a_missing_python(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--json", "decode", "--quick", "--repeat", "1", "--stream-gib", "0.01",
                 "--no-baseline", "--backends", "TORCH_SDPA", "--dtypes", "bf16",
                 "--vllm-python", "/nonexistent/python"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and result["ok"] is False
    assert "cannot run" in result["vllm_comparison"]["error"]
