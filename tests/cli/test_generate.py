"""``python -m app generate``: greedy tokens from a checkpoint directory, as ids or text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app.cli import main
from tests.model.hf_checkpoints import hf_greedy, hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """The tiny V3-like checkpoint (and its transformers model), with a word-level
    tokenizer.json of 256 tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("gen")
    model = hf_model("v3")
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))
    return model, path


def test_generate_json_gives_transformers_tokens(checkpoint: tuple[object, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model, path = checkpoint
    assert main(["generate", "--model", str(path), "--prompt-ids", "5,6,7", "--prompt-ids",
                 "9, 10", "--max-new-tokens", "6", "--dtype", "float32", "--ignore-eos",
                 "--no-progress", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    outputs = result["outputs"]
    assert [o["prompt_ids"] for o in outputs] == [[5, 6, 7], [9, 10]]
    for o in outputs:
        assert o["generated_ids"] == hf_greedy(model, o["prompt_ids"], 6)
        assert len(o["logprobs"]) == 6 and all(lp <= 0 for lp in o["logprobs"])
        assert o["finish_reason"] == "length"
    timings = result["timings"]
    assert timings["prefill_tokens"] == 5 and timings["decode_tokens"] == 10
    assert result["model"]["architecture"] == "DeepseekV3ForCausalLM"
    assert result["model"]["compute_dtype"] == "float32"
    assert result["backends"]["prefill"] == "TORCH_SDPA" and result["stop_token_ids"] == []


def test_generate_prints_ids_and_stops_at_eos(checkpoint: tuple[object, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model, path = checkpoint
    assert main(["generate", "--model", str(path), "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "4", "--dtype", "float32", "--no-progress"]) == 0
    out = capsys.readouterr()
    ids = [int(t) for t in out.out.strip().split(",")]
    assert ids == hf_greedy(model, [5, 6, 7], 4)[:len(ids)]
    assert "load [" not in out.err


def test_generate_text_with_the_tokenizer(checkpoint: tuple[object, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model, path = checkpoint
    assert main(["generate", "--model", str(path), "--prompt", "w5 w6 w7",
                 "--max-new-tokens", "3", "--dtype", "float32", "--ignore-eos",
                 "--no-progress"]) == 0
    expected = " ".join(f"w{t}" for t in hf_greedy(model, [5, 6, 7], 3))
    assert capsys.readouterr().out.strip() == expected


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-ids", "1,x"], "expected comma-separated token ids"),
    ([], "give at least one prompt"),
    (["--prompt-ids", "1", "--model", "/nonexistent"], "not a directory"),
    (["--prompt-ids", "999"], r"token ids must be in \[0, 256\)"),
])
def test_generate_usage_errors(checkpoint: tuple[object, Path], args: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    _, path = checkpoint
    argv = ["generate", "--no-progress"] + (args if "--model" in args
                                            else ["--model", str(path), *args])
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_prompt_text_needs_a_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    hf_model("v3").save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello",
                 "--no-progress"]) == 2
    assert "tokenizer.json, which does not exist" in capsys.readouterr().err


def test_generate_help_says_it_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--prompt-ids", "--prompt", "--max-new-tokens", "--dtype",
                 "--ignore-eos", "--json", "FP8", "tokenizer"):
        assert flag in text
