"""What the commands print is what is true (issue 43): an ``fp8_ds_mla`` token is a 656-byte
row (not ``576 uint8``), a sparse model's indexer keys are specs, not layers, a load average is
rounded and set against the cores, TTFT says what it measures, a load in a log is two lines,
and ``backends`` takes the sparse settings."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from app.bench._load import load_text
from app.bench.sparse.bench import render as render_sparse
from app.commands._kv_rows import count_layers, row_text, token_row
from app.commands.run import render as render_run
from app.kvcache.specs import MLAAttentionSpec
from app.model.sparse.kv_spec import IndexerKeyCacheSpec
from tests.cli.conftest import CliRunner, assert_one_line_usage_error

EXAMPLE = Path(__file__).parents[2] / "examples" / "kv_plan_deepseek_v32.toml"


@pytest.mark.parametrize(("cache_dtype", "expected"), [
    ("auto", "1152 B (576 bfloat16)"),
    ("fp8", "576 B (576 e4m3)"),
    ("fp8_ds_mla", "656 B (512 e4m3 + 4 float32 scales + 64 bfloat16 rope)"),
])
def test_a_token_row_is_its_real_bytes_and_layout(cache_dtype: str, expected: str) -> None:
    spec = MLAAttentionSpec.from_dims(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                      dtype="bfloat16", kv_cache_dtype=cache_dtype)
    assert row_text(token_row(spec)) == expected
    key_spec = IndexerKeyCacheSpec(block_size=16, head_size=128, dtype="bfloat16")
    assert row_text(token_row(key_spec)) == "256 B (128 bfloat16)"
    assert count_layers({"MLAAttentionSpec": 61, "IndexerKeyCacheSpec": 61}) == 61


def test_kv_plan_shows_layers_and_specs_apart_and_the_ds_mla_row(
        run_cli: CliRunner, tmp_path: Path) -> None:
    code, out, _ = run_cli("kv-plan", "--config", str(EXAMPLE), "--json")
    plan = json.loads(out)
    assert code == 0 and (plan["num_layers"], plan["num_specs"]) == (61, 122)
    assert (plan["groups"][0]["num_layers"], plan["groups"][0]["num_specs"]) == (61, 122)
    ds_mla = tmp_path / "ds_mla.toml"
    ds_mla.write_text(EXAMPLE.read_text().replace(
        "[cache]\n", '[cache]\nkv_cache_dtype = "fp8_ds_mla"\n'))
    code, out, _ = run_cli("kv-plan", "--config", str(ds_mla))
    assert code == 0
    assert out.startswith("61 layers, 122 KV-cache specs (61 IndexerKeyCacheSpec: a cache "
                          "beside a layer's own, not a layer) in 1 KV-cache group(s)\n")
    assert "(122 specs of 61 layers)" in out and "(122)" not in out
    assert ("61 x MLAAttentionSpec (656 B/token per layer: 512 e4m3 + 4 float32 scales + 64 "
            "bfloat16 rope); 61 x IndexerKeyCacheSpec (256 B/token per layer: 128 bfloat16)"
            in out)
    assert "576 uint8" not in out and "122 layers" not in out


def test_run_prints_the_ds_mla_row_and_ttft_in_context(
        run_cli: CliRunner, tmp_path: Path) -> None:
    deployment = tmp_path / "tiny.toml"
    deployment.write_text('[deployment]\nplatform = "cpu"\n[model]\ndtype = "bfloat16"\n'
                          "num_heads = 2\nhidden_size = 64\nkv_lora_rank = 128\n"
                          "qk_nope_head_dim = 16\nqk_rope_head_dim = 8\nv_head_dim = 16\n")
    code, out, err = run_cli("run", "--json", "--deployment", str(deployment),
                             "--kv-cache-dtype", "fp8_ds_mla", "--num-requests", "3",
                             "--min-len", "8", "--max-len", "40", "--min-new-tokens", "2",
                             "--max-new-tokens", "3", "--num-blocks", "32", "--no-check",
                             "--no-progress", "--no-malloc-tuning")
    assert code == 0, err
    result = json.loads(out)
    [group] = result["kv_cache"]["groups"]
    assert group["row"] == {"bytes": 128 + 4 + 16,
                            "layout": "128 e4m3 + 1 float32 scales + 8 bfloat16 rope"}
    text = render_run(result)
    assert ("block 16 tokens x 148 B (128 e4m3 + 1 float32 scales + 8 bfloat16 rope), page "
            f"{16 * 148} B, 1 layer(s)") in text
    assert "136 uint8" not in text
    [ttft] = [line for line in text.splitlines() if line.startswith("TTFT")]
    assert "over 3 requests, prompts 8-40 tokens, all queued at step 0" in ttft
    assert "from arrival to the first token" in ttft and "median " in ttft


def test_load_averages_are_rounded_against_the_cores() -> None:
    assert load_text(1.9306640625, 2.10302734375, 2) == \
        "load 1.93 -> 2.10 / 2 cores (1-minute average)"
    assert load_text([0.5, 0.25, 0.125], [], 4) == "load 0.50 / 4 cores (1-minute average)"
    assert load_text(None, None, 2) == "load n/a"
    text = render_sparse({"threads": 2, "stream_gbs": 10.0, "peak_kind": "fp32_fma",
                          "peak_gflops": 100.0, "load_avg_1m": [1.9306640625, 2.0],
                          "cores": 2, "rows": []})
    assert "load 1.93 -> 2.00 / 2 cores (1-minute average)" in text
    assert "1.9306640625" not in text


def test_a_load_in_a_log_is_two_lines(tmp_path: Path) -> None:
    from argparse import Namespace

    from app.commands._model import build_model
    from app.config import EngineConfig
    from tests.model.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "tiny")
    log = io.StringIO()   # not a terminal
    build_model(Namespace(model=path, dtype=None), EngineConfig(), progress=True, stream=log)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "[" not in log.getvalue() and "\r" not in log.getvalue()
    assert lines[0] == f"loading {path} ..."
    assert lines[1].startswith("loaded ") and " tensors (" in lines[1]


def test_backends_takes_the_sparse_settings(run_cli: CliRunner) -> None:
    code, out, _ = run_cli("backends", "--kind", "all", "--capability", "cpu",
                           "--index-topk", "2048", "--index-head-dim", "64", "--json")
    info = json.loads(out)
    assert code == 0
    for kind in ("prefill", "decode"):
        assert info[kind]["chosen"] in ("TORCH_SPARSE", "CPU_MLA_SPARSE")
        assert info[kind]["selector_config"]["index_topk"] == 2048
    code, out, _ = run_cli("backends", "--capability", "cpu", "--index-topk", "2048")
    assert code == 0 and "index topk         2048" in out
    code, out, _ = run_cli("backends", "--capability", "cpu")
    assert code == 0 and "index topk         - (dense)" in out
    code, out, err = run_cli("backends", "--index-n-heads", "8")
    assert_one_line_usage_error(code, err, "--index-n-heads: an indexer setting of a sparse "
                                           "model; the model is dense: add --index-topk N")
    assert out == ""
