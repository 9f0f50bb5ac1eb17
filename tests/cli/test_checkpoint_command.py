"""``python -m app checkpoint``: a tiny random checkpoint of every family, that the loader reads
and ``generate`` serves; every bad option refused before anything is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from app.model.loader import check_checkpoint
from tests.cli.conftest import CliRunner, assert_one_line_usage_error

#: Small sizes (the defaults are DeepSeek's attention dims; these keep each write ~1 s).
SMALL = ["--layers", "2", "--heads", "2", "--hidden-size", "64", "--intermediate-size", "64",
         "--vocab-size", "128", "--kv-lora-rank", "32", "--qk-rope-head-dim", "8",
         "--qk-nope-head-dim", "16", "--v-head-dim", "16", "--q-lora-rank", "32",
         "--moe-intermediate-size", "16"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--family", "v3", "--index-topk", "8"],
     ["--index-topk: the sparse families' settings (v32, glm); --family v3 is dense"]),
    (["--family", "v2", "--index-head-dim", "64", "--index-n-heads", "4"],
     ["--index-head-dim, --index-n-heads: the sparse families' settings"]),
    (["--family", "v32", "--indexer-pattern", "FS"],
     ["--indexer-pattern: GLM-5's setting (--family glm), not --family v32's"]),
    (["--family", "glm", "--indexer-pattern", "SF"],
     ["--family glm config: index_topk_pattern = 'SF'", "layer 0 'full'"]),
    (["--family", "glm", "--indexer-pattern", "FSF"],
     ["index_topk_pattern = 'FSF': expected 2 entries"]),
    (["--family", "v32", "--index-head-dim", "32"],
     ["index_head_dim = 32: expected an int >= qk_rope_head_dim (64)"]),
    (["--layers", "0"], ["argument --layers: expected an int in [1, 64], got 0"]),
    (["--family", "v4"], ["argument --family: invalid choice: 'v4'"]),
])
def test_bad_options_are_refused_before_anything_is_written(
        run_cli: CliRunner, tmp_path: Path, argv: list[str], expected: list[str]) -> None:
    code, out, err = run_cli("checkpoint", *argv, str(tmp_path / "ckpt"))
    assert_one_line_usage_error(code, err, *expected)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_the_directory_must_be_new_or_empty(run_cli: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    code, _, err = run_cli("checkpoint", str(tmp_path / "full"))
    assert_one_line_usage_error(code, err, "the directory is not empty")
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli("checkpoint", str(tmp_path / "file"))
    assert_one_line_usage_error(code, err, "expected a new or empty directory")
    code, _, err = run_cli("checkpoint", str(tmp_path / "no" / "such" / "dir"))
    assert_one_line_usage_error(code, err, "its parent directory", "does not exist")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_without_transformers_it_names_the_extra(run_cli: CliRunner, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    code, _, err = run_cli("checkpoint", "--family", "v32", str(tmp_path / "ckpt"))
    assert_one_line_usage_error(code, err, "checkpoint needs transformers",
                                "pip install 'app[test]'")
    assert list(tmp_path.iterdir()) == []


def test_the_help_says_what_it_needs(run_cli: CliRunner) -> None:
    code, out, _ = run_cli("checkpoint", "--help")
    flat = " ".join(out.split())
    assert code == 0
    assert "needs transformers: pip install 'app[test]'" in flat
    for flag in ("--family {v2,v3,v32,glm}", "--index-topk N", "--index-head-dim N",
                 "--index-n-heads N", "--indexer-pattern PATTERN", "DIR"):
        assert flag in flat, flag


@pytest.mark.parametrize(("family", "extra", "architecture"), [
    ("v2", [], "DeepseekV2ForCausalLM"),
    ("v3", ["--layout", "transformers"], "DeepseekV3ForCausalLM"),
    ("v32", ["--index-topk", "4", "--index-head-dim", "16", "--index-n-heads", "2"],
     "DeepseekV32ForCausalLM"),
    ("glm", ["--indexer-pattern", "FS", "--index-head-dim", "16"], "GlmMoeDsaForCausalLM"),
])
def test_every_family_writes_a_checkpoint_the_loader_reads(
        run_cli: CliRunner, tmp_path: Path, family: str, extra: list[str],
        architecture: str) -> None:
    pytest.importorskip("transformers")
    target = tmp_path / family
    code, out, err = run_cli("checkpoint", "--family", family, *SMALL, *extra, str(target),
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["architecture"] == architecture and result["sparse"] == (
        family in ("v32", "glm"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [family]   # no partial folder left
    arch = check_checkpoint(target)
    assert (arch.architecture, arch.num_hidden_layers, arch.kv_lora_rank) == (
        architecture, 2, 32)
    if family == "v32":
        assert arch.indexer is not None and arch.indexer.index_topk == 4
    if family == "glm":
        assert arch.indexer is not None and arch.indexer.layer_has_indexer == (True, False)


def test_a_sparse_checkpoint_serves_generate(run_cli: CliRunner, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    target = tmp_path / "v32"
    code, out, err = run_cli("checkpoint", "--family", "v32", *SMALL, "--index-topk", "4",
                             "--index-head-dim", "16", str(target))
    assert code == 0, err
    assert out.startswith(f"wrote {target}: DeepseekV32ForCausalLM, 2 layers")
    assert f"try: python -m app generate --model {target} --prompt-ids 1,2,3" in out
    code, out, err = run_cli("generate", "--model", str(target), "--prompt-ids",
                             "1,2,3,4,5,6,7,8", "--max-new-tokens", "3", "--ignore-eos",
                             "--no-progress", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["outputs"][0]["generated_ids"]) == 3
    assert result["backends"]["prefill"] in ("TORCH_SPARSE", "CPU_MLA_SPARSE")
