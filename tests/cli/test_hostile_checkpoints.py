"""Hostile checkpoint directories on the command line (issue 33): ``generate``, ``run --model``
and ``bench model`` end in one line on stderr and exit 2, naming the file (and the key), at
once; a broken tokenizer or a broken model is such a line too; ``--json`` output is always
JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from app.commands._output import json_safe, json_text
from tests.cli.conftest import CliRunner, assert_one_line_usage_error
from tests.model.tiny_checkpoint import Tensors, write_tiny_checkpoint
from tests.test_files import FifoWatch

pytest.importorskip("safetensors")

GENERATE = ["generate", "--prompt-ids", "3,4,5", "--max-new-tokens", "3", "--no-progress"]
RUN = ["run", "--num-requests", "2", "--min-len", "4", "--max-len", "12", "--min-new-tokens",
       "2", "--max-new-tokens", "3", "--step-tokens", "32", "--num-blocks", "32",
       "--no-progress", "--no-malloc-tuning"]
BENCH = ["bench", "model", "--prompt-len", "4", "--new-tokens", "2", "--batch", "1",
         "--repeat", "1"]
COMMANDS = {"generate": GENERATE, "run": RUN, "bench model": BENCH}


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_config_counting_a_billion_layers_is_refused_at_once(
        run_cli: CliRunner, tmp_path: Path, command: str) -> None:
    """It grew memory by ~100 MB/s forever: every layer's weight specs were built first."""
    path = write_tiny_checkpoint(tmp_path / "ckpt",
                                 config=lambda c: c.update(num_hidden_layers=10**9))
    code, out, err = run_cli(*COMMANDS[command], "--model", str(path))
    assert_one_line_usage_error(code, err, f"{path / 'config.json'}: num_hidden_layers = "
                                "1000000000, but the checkpoint's tensors hold 2 decoder layer(s)")
    assert out == ""


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "generation_config.json"])
def test_a_fifo_in_the_checkpoint_is_one_line(run_cli: CliRunner, tmp_path: Path,
                                              name: str) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    if (path / name).exists():
        (path / name).unlink()
    fifo = FifoWatch(path / name)
    code, out, err = run_cli(*GENERATE, "--model", str(path))
    assert not fifo.stop(), "the FIFO was opened for reading"
    assert_one_line_usage_error(code, err, str(path / name), "is a FIFO (named pipe)")
    assert out == ""


@pytest.mark.parametrize(("edit", "expected"), [
    ({"rope_theta": 1.0}, "rope_theta = 1.0: expected a number > 1"),
    ({"architectures": [["DeepseekV3ForCausalLM"]]}, "architectures = [['Deepseek"),
    ({"eos_token_id": [True, False]}, "eos_token_id = [True, False]: expected a token id"),
])
def test_config_values_are_named_with_the_file_and_the_key(
        run_cli: CliRunner, tmp_path: Path, edit: dict[str, object], expected: str) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt", config=lambda c: c.update(edit))
    code, _, err = run_cli(*GENERATE, "--model", str(path))
    assert_one_line_usage_error(code, err, str(path / "config.json"), expected)


def _nan(tensors: Tensors) -> None:
    tensors["model.layers.1.self_attn.kv_b_proj.weight"].fill_(float("nan"))


@pytest.mark.parametrize("command", ["generate", "generate --json", "run", "run --json"])
def test_nan_weights_are_an_error_naming_the_layer_never_tokens(
        run_cli: CliRunner, tmp_path: Path, command: str) -> None:
    """They gave tokens from all-NaN logits with exit 0, and --json printed NaN."""
    path = write_tiny_checkpoint(tmp_path / "ckpt", tensors=_nan)
    name, *flags = command.split()
    code, out, err = run_cli(*COMMANDS[name], *flags, "--model", str(path))
    assert_one_line_usage_error(code, err, "the model's logits are not finite (NaN or infinite) "
                                "in step 1; the first stage that produced a non-finite value: "
                                "layer 1's attention (model.layers.1.self_attn)")
    assert out == ""


def test_generate_json_is_strict_json(run_cli: CliRunner, tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    code, out, err = run_cli(*GENERATE, "--json", "--model", str(path))
    assert code == 0, err
    result = _strict_json(out.splitlines()[-1])
    assert isinstance(result, dict) and len(result["outputs"][0]["generated_ids"]) >= 1


def test_json_output_never_holds_nan_or_infinity() -> None:
    data = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (2, {"d": math.nan})}
    assert json_safe(data) == {"a": None, "b": [None, None, 1.5], "c": [2, {"d": None}]}
    assert _strict_json(json_text(data)) == json_safe(data)
    assert json_text({"x": Path("/p")}, indent=2) == '{\n  "x": "/p"\n}'


# -- tokenizer.json ------------------------------------------------------------------------


def _tokenizer(path: Path, pattern: str | None = None) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 2, "a": 3, "b": 4, "x": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace() if pattern is None else \
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), "isolated")
    (path / "tokenizer.json").write_text(tok.to_str())


def test_a_good_tokenizer_still_works(run_cli: CliRunner, tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _tokenizer(path)
    code, out, err = run_cli(*GENERATE[:1], "--prompt", "a b a", "--max-new-tokens", "2",
                             "--no-progress", "--json", "--model", str(path))
    assert code == 0, err
    result = _strict_json(out.splitlines()[-1])
    assert isinstance(result, dict) and result["outputs"][0]["prompt_ids"] == [3, 4, 3]


def test_a_backtracking_tokenizer_regex_is_one_line_not_a_panic(
        run_cli: CliRunner, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The Rust regex gave up and the package panicked: a ``PanicException``, which is a
    ``BaseException``, passed the CLI's catch-all as a traceback (after Rust printed its own
    panic and backtrace on file descriptor 2)."""
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _tokenizer(path, pattern="(x+x+)+y")
    code, out, err = run_cli("generate", "--prompt", "x" * 40 + "!", "--no-progress",
                             "--model", str(path))
    assert_one_line_usage_error(code, err, str(path / "tokenizer.json"),
                                "the tokenizer panicked encoding a prompt (PanicException: ")
    assert out == ""
    assert "panicked at" not in capfd.readouterr().err    # Rust's own report was captured


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
@pytest.mark.parametrize(("kind", "expected"), [
    ("invalid", "the tokenizer failed reading it (Exception: "),
    ("fifo", "is a FIFO (named pipe), not a regular file"),
    ("dev-zero", "is a character device, not a regular file"),
    ("not-utf8", "tokenizer.json is not UTF-8 text"),
    ("missing", "which does not exist; pass token ids with --prompt-ids"),
])
def test_a_bad_tokenizer_file_is_one_line_naming_it(run_cli: CliRunner, tmp_path: Path,
                                                    kind: str, expected: str) -> None:
    pytest.importorskip("tokenizers")
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    target = path / "tokenizer.json"
    fifo = None
    if kind == "invalid":
        target.write_text('{"model": 5}')
    elif kind == "fifo":
        fifo = FifoWatch(target)
    elif kind == "dev-zero":
        target.symlink_to("/dev/zero")
    elif kind == "not-utf8":
        target.write_bytes(b'{"a": "\xff"}')
    code, out, err = run_cli("generate", "--prompt", "a b", "--no-progress", "--model",
                             str(path))
    assert fifo is None or not fifo.stop(), "the FIFO was opened for reading"
    assert_one_line_usage_error(code, err, str(target), expected)
    assert out == ""
