"""The command line on sparse models: ``generate --model`` and ``run --model`` on DeepSeek-V3.2
and GLM-MoE-DSA checkpoints (transformers' tokens; the float64 check, selection near-ties
counted), ``backends`` for a sparse model, ``kv-plan`` with the indexer's key cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.cli import main
from tests.model.hf_checkpoints import hf_greedy
from tests.model.sparse_checkpoints import hf_sparse_model

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).parents[2] / "examples" / "kv_plan_deepseek_v32.toml"
PROMPT = ",".join(str(3 + (7 * i) % 250) for i in range(60))


@pytest.fixture(scope="module", params=["v32", "glm"])
def sparse_checkpoint(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = hf_sparse_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_generate_on_a_sparse_checkpoint_gives_transformers_tokens(
        sparse_checkpoint: tuple[Any, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, path = sparse_checkpoint
    assert main(["generate", "--model", str(path), "--prompt-ids", PROMPT, "--max-new-tokens",
                 "5", "--dtype", "float32", "--ignore-eos", "--no-progress", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prompt = [int(t) for t in PROMPT.split(",")]
    assert result["outputs"][0]["generated_ids"] == hf_greedy(model, prompt, 5)
    assert result["backends"]["prefill"] == "TORCH_SPARSE"
    assert result["model"]["indexer"]["index_topk"] == 8


def test_run_on_a_sparse_checkpoint_passes_its_float64_check(
        sparse_checkpoint: tuple[Any, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, path = sparse_checkpoint
    assert main(["run", "--json", "--model", str(path), "--dtype", "float32",
                 "--num-requests", "3", "--min-len", "20", "--max-len", "80",
                 "--step-tokens", "48", "--min-new-tokens", "2", "--max-new-tokens", "5",
                 "--num-blocks", "128", "--no-progress", "--no-malloc-tuning"]) == 0
    result = json.loads(capsys.readouterr().out)
    check = result["check"]
    assert check["passed"] is True and check["token_mismatches"] == 0
    assert "selection_near_ties" in check
    assert check["prefill_rows_checked"] + check["decode_rows_checked"] > 20


def test_backends_explains_a_sparse_model(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    deployment = tmp_path / "deploy.toml"
    deployment.write_text('[deployment]\nplatform = "cpu"\n\n[model]\nindex_topk = 2048\n')
    assert main(["backends", "--deployment", str(deployment), "--kind", "decode",
                 "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    decode = info.get("decode", info)
    native = CpuSparseDecodeBackend.is_available()  # the CPU prefers the native kernel
    assert decode["chosen"] == ("CPU_MLA_SPARSE" if native else "TORCH_SPARSE")
    assert any("sparse not supported" in r for r in decode["backends"]["CPU_MLA"]["reasons"])


def test_kv_plan_shows_the_indexer_keys_and_bytes_per_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv-plan", "--config", str(EXAMPLE), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    [group] = plan["groups"]
    specs = {s["type"]: s for s in group["specs"]}
    assert specs["IndexerKeyCacheSpec"]["num_layers"] == 61
    assert specs["IndexerKeyCacheSpec"]["bytes_per_token_per_layer"] == 128 * 2
    assert specs["MLAAttentionSpec"]["bytes_per_token_per_layer"] == 576 * 2
    assert plan["bytes_per_token"] == 61 * (576 + 128) * 2
    assert main(["kv-plan", "--config", str(EXAMPLE)]) == 0
    text = capsys.readouterr().out
    assert "61 x IndexerKeyCacheSpec (256 B/token per layer: 128 bfloat16)" in text
    assert "bytes per token: 85888" in text


def test_run_on_a_sparse_checkpoint_with_an_fp8_cache(
        sparse_checkpoint: tuple[Any, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A sparse model over an ``fp8`` latent cache: the engine computes what the float64
    check's dtype reference computes with its keys and values through the same cache (so the
    check passes with the derived tolerance), and the pool says which cache it keeps."""
    _, path = sparse_checkpoint
    assert main(["run", "--json", "--model", str(path), "--dtype", "float32",
                 "--kv-cache-dtype", "fp8", "--num-requests", "3", "--min-len", "20",
                 "--max-len", "80", "--step-tokens", "48", "--min-new-tokens", "2",
                 "--max-new-tokens", "5", "--num-blocks", "128", "--no-progress",
                 "--no-malloc-tuning"]) == 0
    result = json.loads(capsys.readouterr().out)
    check = result["check"]
    assert check["passed"] is True and check["token_mismatches"] == 0
    assert check["max_relative_error"] <= 1.01 * check["dtype_max_relative_error"] + 1e-6
    assert result["kv_cache"]["pool"]["kv_cache_dtype"] == "fp8"
